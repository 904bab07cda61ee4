"""Bytes on the host and on disk: swap files for ZeRO-Infinity (`swap`, `swap_folders`), the
safetensors format written and read piece by piece (`safetensors`), the full-disk error
(`disk_space`) and the host allocator's policy (`host_memory`). No communication.
"""
