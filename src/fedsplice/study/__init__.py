"""The study: the results page's machinery (`fedsplice results`, `make results`): suites of runs,
validation tuning, provenance and records, the papers' claims and the statistics that decide
them, and the page's tables and plots.

It is not the library: it uses the library's public API (fedsplice.app's runner, compare and
run directories; the config) the way a user's own study would, and nothing in the library imports
it (the "study apart" contract in .importlinter, tested by tests/test_layout.py). Its command
reaches the `fedsplice` CLI through the entry-point group "fedsplice.commands"."""
