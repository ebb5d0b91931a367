"""Quantized weights and KV cache: `--quantization` (linear-layer methods behind a registry, and
pre-quantized checkpoints read as published) and `--kv-cache-dtype` (an FP8 KV pool).

`build.build_linear_method` decides from the flags and the checkpoint's `quantization_config` whether and
how the model's linear layers are quantized; `device.resolve_kv_dtype` gives the KV pool's storage dtype.
Both refuse a device without FP8 (compute capability < 8.9) with the requirement named.
"""

