"""fedsplice benchmarks: scripts that print a table (python benchmarks/<name>.py). A regular package, so
that `benchmarks._common` is ours even beside the top-level `benchmarks` package that opacus installs."""
