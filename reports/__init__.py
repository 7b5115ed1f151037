"""What a run and a study show: the run report (`populora report`), the study's spec, its
scheduler (`populora study`) and its report. Reads run directories; imports the training
job's records and configs, never the other way round."""
