"""Recording and reading back: MLflow holds every sweep and trial, Optuna's storage the study.

- ``stores``: the tracking store and study storage (SQLite files created atomically, journal
  files, URLs printed without passwords);
- ``tracking``: one MLflow parent run per sweep, one child run per trial, written in a batch;
- ``results``: MLflow -> the results table, one typed pandas row per trial.
"""
