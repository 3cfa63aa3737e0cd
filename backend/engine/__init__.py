"""The engine (one step: schedule, run the model, sample, emit), the loop thread that drives it and the output
sender thread that hands results to their callbacks."""
