"""Images in prompts: loading, preprocessing, placeholder expansion, and their runtime on the worker.

Where each part runs: `loading`, `processors` and `prompt` at the edge (the tokenizer service, or the
front-end process of `radixmesh serve` and `Engine`); `runtime` and `mrope` in the scheduler process.
`inputs` holds the typed messages that carry preprocessed images between them.
"""
