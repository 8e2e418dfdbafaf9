"""Data: the offline zoo (registry packages, sha256-checked), the built-in data sets, users' CSV /
JSONL / image folders, client partitions and long-tail scenarios, image caches and the tiny
random models the tests build. No model code, no federation."""
