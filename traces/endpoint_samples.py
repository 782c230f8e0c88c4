"""The record of ``hawk profile --endpoint`` (``traces.endpoint_profile``): one JSON line per
measured point in ``samples.jsonl``, appended as each point is done (a rerun reads what is
there and measures the rest), and the check that a directory holds a profile of the same
settings before resuming it."""

from __future__ import annotations

import json
from pathlib import Path

from traces.endpoint_profile import SAMPLES_FILE, EndpointProfileError


def read_samples(out: Path) -> dict[str, dict]:
    """The points ``samples.jsonl`` holds, by key (a half-written last line is dropped)."""
    path = Path(out) / SAMPLES_FILE
    if not path.is_file():
        return {}
    lines = path.read_text().split("\n")
    if lines[-1]:                                   # no newline after it: cut short
        path.write_text("\n".join(lines[:-1]) + "\n")
    samples = {}
    for number, line in enumerate(lines[:-1], start=1):
        try:
            sample = json.loads(line)
            samples[sample["key"]] = sample
        except (ValueError, KeyError, TypeError):
            raise EndpointProfileError(f"{path}:{number}: not a sample line") from None
    return samples


def append_sample(out: Path, sample: dict) -> None:
    with open(Path(out) / SAMPLES_FILE, "a") as f:
        f.write(json.dumps(sample) + "\n")


def settings_diff(old: dict, new: dict) -> list[str]:
    """What differs between a profile.toml's plan and engine and these (resume check)."""
    keys = [("sweep", k) for k in set(old.get("sweep", {})) | set(new["sweep"])]
    keys += [("serving", k) for k in ("prefill_max_batch_tokens", "decode_max_batch",
                                      "kv_block_tokens", "num_kv_tokens")]
    keys += [("model", "max_context"), ("machine", "endpoint")]
    return [f"{t}.{k} is {new[t].get(k)!r} here, {old.get(t, {}).get(k)!r} in profile.toml"
            for t, k in sorted(keys) if old.get(t, {}).get(k) != new[t].get(k)]
