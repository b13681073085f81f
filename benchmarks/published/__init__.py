"""Harness's CUDA memory predictions against published GPU measurements (``python -m
benchmarks.published``); see README.md in this folder."""
