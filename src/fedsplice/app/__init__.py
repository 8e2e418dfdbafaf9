"""The application layer: the command line, the run driver and its console output, `compare`,
`results` and the paper claims it checks, reports and plots. It sits on top of federation's
public API and the runtimes; nothing below imports it."""
