"""Exact next-token distributions of vanilla sampling and a chi-square test against Vegas samples."""

import math

import torch

import hf_vegas

SAMPLING = dict(do_sample=True, temperature=1.3, top_k=6, top_p=0.9)
NEW_TOKENS = 3
ROWS = 3000


def exact_distribution(model, prompt, sampling=SAMPLING):
    """{token tuple: probability} of the next NEW_TOKENS tokens under vanilla sampling."""
    paths = {(): 1.0}
    for _ in range(NEW_TOKENS):
        prefixes = list(paths)
        ids = torch.cat([prompt.repeat(len(prefixes), 1), torch.tensor([list(p) for p in prefixes]).long()], dim=1)
        out = model.generate(ids, max_new_tokens=1, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                             **sampling)
        probs = torch.softmax(out.scores[0].double(), dim=-1)
        paths = {
            (*prefix, token): paths[prefix] * float(probs[row, token])
            for row, prefix in enumerate(prefixes)
            for token in torch.nonzero(probs[row] > 0).flatten().tolist()
        }
    return paths


def chi_square_p_value(counts: dict, expected: dict, total: int) -> float:
    """Pearson chi-square with cells of expected count < 5 merged; p-value by the Wilson-Hilferty approximation."""
    stat, small_obs, small_exp, cells = 0.0, 0, 0.0, 0
    for key, p in expected.items():
        e, o = p * total, counts.get(key, 0)
        if e < 5:
            small_obs, small_exp = small_obs + o, small_exp + e
        else:
            stat, cells = stat + (o - e) ** 2 / e, cells + 1
    unseen = total - sum(counts.get(k, 0) for k in expected)  # samples outside the support: impossible tokens
    small_obs += unseen
    if small_exp > 0:
        stat, cells = stat + (small_obs - small_exp) ** 2 / small_exp, cells + 1
    elif small_obs:
        return 0.0
    dof = cells - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def vegas_samples(model, prompt, sampling=SAMPLING, **vegas):
    torch.manual_seed(1234)
    out = model.generate(prompt.repeat(ROWS, 1), max_new_tokens=NEW_TOKENS, pad_token_id=0,
                         custom_generate=hf_vegas.generate, return_dict_in_generate=True, **sampling, **vegas)
    counts = {}
    for row in out.sequences[:, prompt.shape[1]:].tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts, out
