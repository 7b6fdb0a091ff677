"""Distributed LLM generation: variable-length token ids and decoded text, gathered with spillmerge.

Generation returns, per prompt and per sample, a different number of token ids and a string.
Gathering them usually means ``gather_object`` (pickling every string and list, staging them on
the GPU under NCCL). spillmerge stores the token ids as a ragged int64 column and the text as a
Zarr string column, without pickle.

CPU (gloo), with torchrun:

    torchrun --standalone --nproc-per-node 4 examples/llm_generate.py --root /tmp/spill --out /tmp/gen.zarr

or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. With a real model
(``transformers``' ``model.generate``), keep the loop as it is: write what ``generate`` returned
for each prompt, on whatever device it is.

Each prompt is a "file" (its id, ``prompts/p_0007``) and each of its ``--samples`` generations a
frame (frame i = sample i), with the value ``{"prompt": str, "token_ids": int64 (L,), "text": str}``
(L differs per sample). Rank 0 merges, then reads back one generation
(``res["prompts/p_0000"]["text"][1]``) and every generation's token ids as one ragged column
(``res.column("token_ids")``), in (prompt, sample) order.

``FakeLM`` is a deterministic stand-in (integer arithmetic on the prompt's bytes, a tiny
vocabulary with non-ASCII words), so ``tests/e2e/test_examples.py`` recomputes every value and
compares bit for bit. Replace it with your model and tokenizer.
"""

from __future__ import annotations

import argparse
import zlib
from typing import Any

import torch
import torch.distributed as dist

import spillmerge

VOCAB = ["<eos>", "the", "cat", "sat", "on", "a", "mat", "café", "naïve", "日本語", "🙂", "and", "then", "slept", "."]
MAX_NEW_TOKENS = 48


def prompts(n: int = 24) -> dict[str, str]:
    """Prompt id -> prompt text."""
    subjects = ["cat", "dog", "robot", "poet", "café owner", "naïve physicist"]
    return {f"prompts/p_{i:04d}": f"Write about a {subjects[i % len(subjects)]} (#{i})." for i in range(n)}


class FakeLM:
    """A stand-in for ``model.generate``: 1..MAX_NEW_TOKENS new tokens, ending with <eos> when
    it stops early, a function of (prompt, sample) only."""

    def generate(self, prompt: str, sample: int) -> torch.Tensor:
        h = zlib.crc32(f"{sample}:{prompt}".encode())
        n = 1 + h % MAX_NEW_TOKENS
        i = torch.arange(n, dtype=torch.int64)
        ids = 1 + (i * 7 + h) % (len(VOCAB) - 1)  # never <eos> inside
        if n < MAX_NEW_TOKENS:
            ids[-1] = 0
        return ids

    def decode(self, ids: torch.Tensor) -> str:
        return " ".join(VOCAB[t] for t in ids.tolist() if t != 0)


def expected_generation(prompt_id: str, sample: int) -> dict[str, Any]:
    """The value written for one (prompt, sample), computed alone (for checking a merged store)."""
    lm, text = FakeLM(), prompts()[prompt_id]
    ids = lm.generate(text, sample)
    return {"prompt": text, "token_ids": ids, "text": lm.decode(ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="spill root shared by all ranks (path or fsspec URL)")
    ap.add_argument("--out", required=True, help="merged Zarr store (path or fsspec URL)")
    ap.add_argument("--backend", default="gloo", help="process group backend: gloo on CPU, nccl on GPUs")
    ap.add_argument("--samples", type=int, default=2, help="generations per prompt")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)  # env:// (torchrun or any launcher that sets RANK ... MASTER_PORT)
    rank, world = dist.get_rank(), dist.get_world_size()
    lm = FakeLM()
    todo = sorted(prompts().items())[rank::world]  # each rank its share of the prompts

    with spillmerge.SpillWriter(args.root) as w:
        for prompt_id, text in todo:
            ids = [lm.generate(text, sample) for sample in range(args.samples)]
            # one batch per prompt: sample s is frame s; token lists are ragged, strings one per item
            batch = {"prompt": [text] * len(ids), "token_ids": ids, "text": [lm.decode(t) for t in ids]}
            w.write_batch([prompt_id] * len(ids), batch, frame_idx=range(len(ids)))
        print(f"rank {rank}: wrote {len(todo) * args.samples} generations", flush=True)
    report = w.merge(args.out, overwrite=True, progress=False)  # merges on rank 0; None elsewhere
    if report is not None:
        print(report, flush=True)
        res = spillmerge.open(args.out)
        first = res.filenames[0]
        print(f"{first} sample 1: {res[first]['text'][1]!r}", flush=True)
        column = res.column("token_ids")  # every generation's ids, (prompt, sample) order
        lengths = [len(t) for t in column.to_list()]
        print(f"{len(lengths)} generations, {sum(lengths)} tokens, {min(lengths)}-{max(lengths)} per generation",
              flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
