"""`harnessrl run`: a TrainingRun on one machine, with processes where the operator uses pods."""
