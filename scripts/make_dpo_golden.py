"""Golden values of the DPO family's losses and metrics from Hugging Face TRL, on fixed log-probabilities.

    python3 -m venv /tmp/venv-trl && /tmp/venv-trl/bin/pip install torch==2.13.0 trl==1.16.0
    /tmp/venv-trl/bin/python scripts/make_dpo_golden.py   # writes tests/golden/dpo/trl.npz

CI has no torch: tests/test_preference.py compares jaxformer.post_train with the file written here.
TRL's own code computes every value: DPO's sigmoid and IPO through `DPOTrainer._compute_loss` (a
stand-in model returns the per-token log-probs, as TRL's fused head does, 0 where the label is masked;
the reference's log-probs are given precomputed); DPO with label smoothing (cDPO) and SimPO through
`CPOTrainer.cpo_loss` (cDPO on the policy's log-ratios over the reference, which is DPO's margin);
ORPO's odds-ratio term through `ORPOTrainer.odds_ratio_loss`; completion-only sums and means of token
log-probs through `ORPOTrainer.get_batch_logps`.
"""

from __future__ import annotations

import collections
import pathlib
import types

import numpy as np
import torch
import trl
from trl import DPOTrainer
from trl.experimental.cpo import CPOTrainer
from trl.experimental.orpo import ORPOTrainer

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "golden" / "dpo" / "trl.npz"
B, L, V = 6, 9, 11  # pairs, positions, vocabulary
BETA, SMOOTHING, GAMMA = 0.2, 0.15, 0.6


class _Accelerator:
    device = "cpu"

    def gather(self, x):
        return x

    gather_for_metrics = gather


def _inputs(rng):
    """Per-token log-probs [2B, L-1] of chosen rows then rejected rows, completion masks [2B, L]."""
    logp = -rng.gamma(2.0, 0.6, (2 * B, L - 1))
    ref = logp + rng.normal(0, 0.4, logp.shape)
    ref = np.minimum(ref, -1e-3)
    prompt = rng.integers(1, 4, 2 * B)
    prompt[B:] = prompt[:B]  # a pair shares its prompt
    end = rng.integers(6, L + 1, 2 * B)  # completion up to here, padding after
    mask = ((np.arange(L)[None] >= prompt[:, None]) & (np.arange(L)[None] < end[:, None])).astype(np.int64)
    return logp, ref, mask


def _dpo(loss_type, logp, ref, mask):
    """TRL's DPO loss and metrics on the given per-token log-probs (its `_compute_loss`, unchanged)."""
    shift = mask[:, 1:]
    ref_sums = (ref * shift).sum(1)

    class Model(torch.nn.Module):
        training = True

        def forward(self, input_ids, labels=None, **_):
            keep = (labels[:, 1:] != -100).float()
            lp = torch.tensor(logp, dtype=torch.float64) * keep
            n = lp.shape[0]
            return types.SimpleNamespace(
                log_probs=lp,
                entropy=torch.zeros_like(lp),
                mean_logits=torch.zeros_like(lp),
                is_top1=torch.zeros(lp.shape, dtype=torch.bool),
                aux_loss=torch.zeros(()),
                logits=torch.zeros(n, lp.shape[1] + 1, 2),
            )

    model = Model()
    me = types.SimpleNamespace(
        model=model, accelerator=_Accelerator(), aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=BETA, label_smoothing=0.0,
        use_weighting=False, _metrics={"train": collections.defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    inputs = {
        "input_ids": torch.ones(2 * B, L, dtype=torch.long),
        "attention_mask": torch.ones(2 * B, L, dtype=torch.long),
        "completion_mask": torch.tensor(mask),
        "ref_chosen_logps": torch.tensor(ref_sums[:B]),
        "ref_rejected_logps": torch.tensor(ref_sums[B:]),
    }
    loss = DPOTrainer._compute_loss(me, model, inputs, return_outputs=False)
    metrics = {k: v[-1] for k, v in me._metrics["train"].items() if k.startswith(("rewards/", "logps/"))}
    return float(loss), metrics


def _cpo(loss_type, chosen, rejected, smoothing):
    me = types.SimpleNamespace(alpha=0.0, accelerator=_Accelerator(), loss_type=loss_type, beta=BETA,
                               simpo_gamma=GAMMA, label_smoothing=smoothing)  # fmt: skip
    losses, rc, rr = CPOTrainer.cpo_loss(me, torch.tensor(chosen), torch.tensor(rejected))
    return losses.numpy(), rc.numpy(), rr.numpy()


def main() -> None:
    rng = np.random.default_rng(45)
    logp, ref, mask = _inputs(rng)
    shift = mask[:, 1:]
    sums, counts = (logp * shift).sum(1), shift.sum(1)
    ref_sums = (ref * shift).sum(1)
    means = sums / counts
    out = {"token_logps": logp, "ref_token_logps": ref, "completion_mask": mask, "beta": BETA,
           "label_smoothing": SMOOTHING, "simpo_gamma": GAMMA}  # fmt: skip
    for loss_type in ("sigmoid", "ipo"):
        loss, metrics = _dpo(loss_type, logp, ref, mask)
        out[f"{loss_type}/loss"] = loss
        for k, v in metrics.items():
            out[f"{loss_type}/{k}"] = v
    # cDPO: the sigmoid loss with label smoothing, on the policy's log-ratios over the reference
    losses, rc, rr = _cpo("sigmoid", sums[:B] - ref_sums[:B], sums[B:] - ref_sums[B:], SMOOTHING)
    out |= {"cdpo/losses": losses, "cdpo/rewards_chosen": rc, "cdpo/rewards_rejected": rr}
    for smoothing, name in ((0.0, "simpo"), (SMOOTHING, "simpo_smoothed")):
        losses, rc, rr = _cpo("simpo", means[:B], means[B:], smoothing)
        out |= {f"{name}/losses": losses, f"{name}/rewards_chosen": rc, f"{name}/rewards_rejected": rr}
    me = types.SimpleNamespace(beta=BETA, accelerator=_Accelerator())
    losses, rc, rr, ratio, log_odds = ORPOTrainer.odds_ratio_loss(me, torch.tensor(means[:B]), torch.tensor(means[B:]))
    out |= {"orpo/losses": losses.numpy(), "orpo/rewards_chosen": rc.numpy(), "orpo/rewards_rejected": rr.numpy(),
            "orpo/log_odds_ratio": float(ratio), "orpo/log_odds_chosen": float(log_odds)}  # fmt: skip
    # Completion-only log-probs from logits: labels -100 on the prompt and padding, shifted inside
    logits = rng.normal(0, 2, (2 * B, L, V))
    ids = rng.integers(0, V, (2 * B, L))
    labels = np.where(mask == 1, ids, -100)
    for average in (False, True):
        got = ORPOTrainer.get_batch_logps(torch.tensor(logits), torch.tensor(labels), average_log_prob=average)
        out[f"batch_logps/{'mean' if average else 'sum'}"] = got.numpy()
    out |= {"logits": logits, "ids": ids}
    out = {k: np.asarray(v) for k, v in out.items()}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, trl_version=np.asarray(trl.__version__), torch_version=np.asarray(torch.__version__),
                        **out)  # fmt: skip
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes) with trl {trl.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
