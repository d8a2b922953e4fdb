"""The TrainingRun spec: the single source of truth for the API, the CRD and validation messages."""
