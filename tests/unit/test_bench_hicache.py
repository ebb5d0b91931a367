"""The multi-turn driver of `radixmesh bench hicache` on a tiny model: sessions come round in turn, every
turn resends the history, and the host tier raises the hit rate of a working set larger than the pool."""

from __future__ import annotations

import argparse

from radixmesh.engine.bench.hicache import MultiTurnDriver, make_sessions, summarize

from .scheduler_factory import VOCAB, assert_no_leak, make_scheduler


def run(hierarchical: bool) -> dict[str, object]:
    args = argparse.Namespace(num_turns=3, turn_input_len=20, output_len=4, num_sessions=0, working_set_ratio=3.0,
                              max_concurrency=3, seed=1)
    sched, _ = make_scheduler(max_total_tokens=200, enable_hierarchical_cache=hierarchical, hicache_ratio=6.0)
    sessions = make_sessions(args, VOCAB, sched.kv.capacity)
    assert len(sessions) == round(3.0 * 200 / (3 * 24))  # the final histories: 3x the pool
    driver = MultiTurnDriver(sched, sessions, args.max_concurrency)
    sched.emit = driver
    result = driver.run()
    assert all(len(s.history) == 3 * 24 for s in sessions) and not driver.inflight
    assert result.output_tokens == len(sessions) * 3 * 4
    assert result.prompt_tokens == len(sessions) * (20 + 44 + 68)
    assert sched.flush_cache()
    assert_no_leak(sched)
    return summarize("with" if hierarchical else "without", result, sched.stats())


def test_host_tier_multiplies_the_hit_rate_of_a_working_set_three_times_the_pool() -> None:
    without, with_host = run(False), run(True)
    assert float(with_host["cache_hit_rate"]) > 3 * float(without["cache_hit_rate"])  # type: ignore[arg-type]
    assert with_host["hicache_num_loads"] and "hicache_num_loads" not in without


def test_the_command_runs_both_modes_and_reports_json(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from radixmesh.cli import main

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 1,
              "eos_token_id": 2, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "result.jsonl"
    assert main(["bench", "hicache", "--model", str(tmp_path), "--device", "cpu", "--max-total-tokens", "200",
                 "--num-turns", "2", "--turn-input-len", "24", "--output-len", "3", "--max-concurrency", "2",
                 "--hicache-ratio", "6", "--result-file", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["run"] for r in report["runs"]] == ["without", "with"]
    without, with_host = report["runs"]
    assert with_host["hicache_num_loads"] > 0 and with_host["cache_hit_rate"] > without["cache_hit_rate"]
    assert report["hit_rate_ratio"] is None if without["cache_hit_rate"] == 0 else report["hit_rate_ratio"] > 1
    assert "hit rate x" in capsys.readouterr().out
