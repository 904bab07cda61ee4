"""Numbers and their encodings: dtype names and the fp16 loss scaler (`precision`), blockwise
INT8/INT4 and bitsandbytes NF4/FP4 quantization (`quant`), and bitsandbytes parameters seen as
raw bytes (`packed`). Pure tensor code: no communication, no files.
"""
