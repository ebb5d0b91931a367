"""The vocabulary that crosses processes, below both the engine and the services.

Sampling parameters (`sampling`), the front end <-> scheduler messages and token outputs (`messages`,
`outputs`), multimodal inputs (`images`), prefill/decode disaggregation messages (`disagg`), KV events and
block hashes (`kv_events`, `block_hash`), a worker's load (`load`), a tokenizer's identity (`fingerprint`), chat
conversations with tools for the tokenizer service (`chat_convert`),
and the converters to and from the protobuf contracts (`convert`). Modules here import only
`radixmesh.common`, `radixmesh.protocol` and each other, so every process (engine, worker, router, gateway,
tokenizer) can speak them.
"""
