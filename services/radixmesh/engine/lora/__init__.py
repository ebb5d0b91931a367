"""Many LoRA adapters on one base model: loading (adapter.py), device slots (slots.py), the batched layers
(layers.py), the runner's per-pass state (runtime.py) and the scheduler's slot manager (manager.py, hook.py)."""
