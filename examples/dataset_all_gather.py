"""Every rank tokenises a shard of a dataset, filters it, and every rank then trains on the union.

The usual way is ``dist.all_gather_object`` of each rank's samples: every sample is pickled,
under NCCL the pickled bytes are staged on the GPU (CUDA OOM although the data is on the CPU), and
every rank unpickles every other rank's data at once. ``spillmerge.all_gather`` replaces that one
call: each rank writes its samples to shared storage, rank 0 merges them into one Zarr store, and
every rank returns once the store is complete and reads what it needs, when it needs it.

CPU (gloo), with torchrun:

    torchrun --standalone --nproc-per-node 4 examples/dataset_all_gather.py --out /shared/tokens.zarr

or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. ``--out`` must be storage
every rank can read (a shared file system or ``s3://...``); the spill root defaults to
``OUT.spill`` next to it and is removed once the merge is done.

Each rank "tokenises" its shard of the documents (document i goes to rank i % world) into a
sample ``{"input_ids": int64 (L,), "loss_mask": bool (L,)}`` of its own length L, drops the samples
whose loss mask is all zero (nothing to learn from), and calls
``spillmerge.all_gather({doc_id: (0, sample)}, out)``. Every rank then reads the union: one sample
by id (``store[doc_id]["input_ids"][0]``) or every sample as one ragged column
(``store.column("input_ids").to_list()``, one array per sample in doc-id order; ``.values`` and
``.offsets`` are its flat form).

``--compare`` also runs ``dist.all_gather_object`` on the same samples in the same run and checks
that every rank read exactly the same samples, bit for bit (the tests run it this way at W=4).
"""

from __future__ import annotations

import argparse
import zlib

import torch
import torch.distributed as dist

import spillmerge

WORDS = ["the", "model", "reads", "every", "token", "of", "a", "long", "document", "and", "learns", "."]


def documents(n: int = 200) -> dict[str, str]:
    """Doc id -> text: 1 to 120 words each."""
    docs = {}
    for i in range(n):
        h = zlib.crc32(f"doc{i}".encode())
        docs[f"doc_{i:05d}"] = " ".join(WORDS[(h >> (j % 24)) % len(WORDS)] for j in range(1 + h % 120))
    return docs


def tokenise(doc_id: str, text: str) -> dict[str, torch.Tensor]:
    """A stand-in tokenizer: one id per word (its position in WORDS, offset by 100), plus a loss
    mask that is all zero for "prompt-only" documents (every 5th, by crc) and otherwise masks the
    first quarter of the tokens (the prompt)."""
    ids = torch.tensor([100 + WORDS.index(w) for w in text.split()], dtype=torch.int64)
    mask = torch.ones(len(ids), dtype=torch.bool)
    mask[: len(ids) // 4] = False
    if zlib.crc32(doc_id.encode()) % 5 == 0:
        mask[:] = False
    return {"input_ids": ids, "loss_mask": mask}


def my_samples(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's shard, tokenised and filtered: samples whose loss mask is all zero are dropped."""
    shard = sorted(documents().items())[rank::world]
    samples = {doc_id: tokenise(doc_id, text) for doc_id, text in shard}
    return {doc_id: s for doc_id, s in samples.items() if bool(s["loss_mask"].any())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="merged Zarr store every rank can read (path or fsspec URL)")
    ap.add_argument("--backend", default="gloo", help="process group backend: gloo on CPU, nccl on GPUs")
    ap.add_argument("--compare", action="store_true", help="also all_gather_object the same samples and compare")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)  # env:// (torchrun or any launcher that sets RANK ... MASTER_PORT)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = my_samples(rank, world)
    print(f"rank {rank}: kept {len(mine)} samples of its shard", flush=True)

    # The one call that replaces all_gather_object: {doc_id: (frame 0, sample)} from every rank.
    store = spillmerge.all_gather({doc_id: (0, s) for doc_id, s in mine.items()}, args.out, progress=False)

    # Every rank reads the union, e.g. to build its training set.
    input_ids = store.column("input_ids").to_list()  # one ragged column over every sample, in doc-id order
    loss_mask = store.column("loss_mask").to_list()
    union = {
        doc_id: {"input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(mask)}
        for doc_id, ids, mask in zip(store.filenames, input_ids, loss_mask, strict=True)
    }
    n_tokens = sum(len(s["input_ids"]) for s in union.values())
    print(f"rank {rank}: read {len(union)} samples, {n_tokens} tokens", flush=True)

    if args.compare:
        gathered: list[dict[str, dict[str, torch.Tensor]] | None] = [None] * world
        dist.all_gather_object(gathered, mine)
        theirs = {k: v for part in gathered if part is not None for k, v in part.items()}
        assert sorted(theirs) == list(union), "the sample ids differ from all_gather_object's"
        for doc_id, s in theirs.items():
            for leaf, t in s.items():
                got = union[doc_id][leaf]
                assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), (doc_id, leaf)
        print(f"rank {rank}: identical to all_gather_object ({len(theirs)} samples)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
