"""A dummy-weights model directory of a named shape that speaks the default model's tokenizer.

Structured-output benchmarks need real token strings (the grammar masks the vocabulary), and the
GPU machine has no network to fetch the default model. So:

    python scripts/gpu_tokenizer_model.py --stage DIR
        (here, with the default model installed) copies its tokenizer files into DIR;
    python scripts/gpu_tokenizer_model.py SHAPE DIR OUT
        (there) writes OUT/config.json: SHAPE's dims with the default model's vocabulary and
        special tokens, plus DIR's tokenizer files; prints OUT for `--model OUT --load-format dummy`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
TOKEN_KEYS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")


def stage(dest: Path) -> None:
    from radixmesh.engine.loader import ensure_default_model

    src = ensure_default_model(progress=True)
    dest.mkdir(parents=True, exist_ok=True)
    for name in (*TOKENIZER_FILES, "config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)
    print(dest)


def build(shape: str, tokenizer_dir: Path, out: Path) -> None:
    from radixmesh.engine.loader.dummy import NAMED_SHAPES

    if shape not in NAMED_SHAPES:
        sys.exit(f"unknown shape {shape!r} (known: {', '.join(sorted(NAMED_SHAPES))})")
    source = json.loads((tokenizer_dir / "config.json").read_text())
    config = dict(NAMED_SHAPES[shape])
    config.update({key: source[key] for key in TOKEN_KEYS if key in source})
    config["tie_word_embeddings"] = False
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    print(out)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--stage":
        stage(Path(sys.argv[2]))
    elif len(sys.argv) == 4:
        build(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(__doc__)
