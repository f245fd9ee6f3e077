"""Shared helpers for the sampling tests."""
import numpy as np


def sequences(out, pad_id: int = 0) -> dict[str, np.ndarray]:
    """A SampleOutput's prompt + response as one left-padded row each, for recomputing the
    sampler's log-probs with the trainer's model.

    Returns input_ids int32 [N, P + M] (concat of prompt_tokens and tokens), segment_ids
    int32 [N, P + M] (1 on prompt and response tokens up to ``lengths``, else 0),
    response_mask float32 [N, P + M] (1 on response tokens up to ``lengths``) and
    old_logprobs float32 [N, P + M] (the sampler's logprob at each response token's own
    position; a model predicts position t from t - 1, so shift targets by one).
    """
    N, P = out.prompt_tokens.shape
    M = out.tokens.shape[1]
    resp = np.arange(M)[None, :] < out.lengths[:, None]
    prompt_real = np.arange(P)[None, :] >= (P - out.prompt_lengths[:, None])
    tokens = np.where(resp, out.tokens, pad_id)
    return {
        "input_ids": np.concatenate([out.prompt_tokens, tokens], 1).astype(np.int32),
        "segment_ids": np.concatenate([prompt_real, resp], 1).astype(np.int32),
        "response_mask": np.concatenate([np.zeros((N, P), bool), resp], 1).astype(np.float32),
        "old_logprobs": np.concatenate([np.zeros((N, P), np.float32),
                                        np.where(resp, out.logprobs, 0.0)], 1),
    }
