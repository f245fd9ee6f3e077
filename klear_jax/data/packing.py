"""Pure numpy helpers around packing: fit a record to the row length, and turn grain's
packed rows into training arrays (next-token targets that never cross a segment)."""
from __future__ import annotations

import numpy as np


def fit_to_length(ex: dict, seq_len: int) -> dict[str, np.ndarray]:
    """Record -> {input_ids int32 [L], loss_mask int32 [L]} with L <= seq_len (truncating)."""
    ids = np.asarray(ex["input_ids"], np.int32)[:seq_len]
    mask = np.asarray(ex["loss_mask"], np.int32)[:seq_len]
    if ids.shape != mask.shape:
        raise ValueError(f"input_ids {ids.shape} and loss_mask {mask.shape} differ in length")
    return {"input_ids": ids, "loss_mask": mask}


def finalize_packed(b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """grain packed batch -> training batch, all [B, T].

    Input keys: input_ids, loss_mask (1 on response tokens, aligned with input_ids),
    input_ids_segment_ids, input_ids_positions.
    Output: input_ids, targets (= input_ids[t+1] when t+1 is in the same segment, else 0),
    loss_mask float32 (= record mask of the target token, 0 where there is no target),
    segment_ids (0 = padding), positions.
    """
    ids = b["input_ids"].astype(np.int32)
    seg = b["input_ids_segment_ids"].astype(np.int32)
    pos = b["input_ids_positions"].astype(np.int32)
    same = np.zeros(ids.shape, bool)
    same[:, :-1] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
    targets = np.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    targets = np.where(same, targets, 0).astype(np.int32)
    mask = np.zeros(ids.shape, np.float32)
    mask[:, :-1] = b["loss_mask"][:, 1:] > 0
    mask = np.where(same, mask, 0.0).astype(np.float32)
    ids = np.where(seg > 0, ids, 0).astype(np.int32)
    pos = np.where(seg > 0, pos, 0).astype(np.int32)
    return {"input_ids": ids, "targets": targets, "loss_mask": mask, "segment_ids": seg, "positions": pos}


def pad_rows(b: dict[str, np.ndarray], batch_size: int, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Rows ``rows`` of a packed batch [b, ...] padded to ``batch_size`` rows with zeros
    (segment id 0: padding, no loss). Pads only the short last batch of a finite run."""
    out = {}
    for k, v in b.items():
        v = np.asarray(v)
        if v.shape[0] < batch_size:
            v = np.concatenate([v, np.zeros((batch_size - v.shape[0],) + v.shape[1:], v.dtype)])
        out[k] = v[rows]
    return out
