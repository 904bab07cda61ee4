"""``hf-zero doctor``: from a measured profile (`hf_zero.profiling`) to what is over budget and
the smallest change that fixes it, with predicted numbers."""
