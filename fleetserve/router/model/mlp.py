"""The MLP router: one hidden layer from the prompt's features to a score per model.

``score_m(x) = W2[m] . relu(W1 x + b1) + b2[m]``, trained like mf on pairwise battles (the logit of
"a beats b" is ``score_a - score_b``), so it gives win rates between any two of several models.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MlpParams:
    """Size and training of the network."""

    # Hidden units.
    hidden: int = 64
    # Full-batch Adam steps, learning rate and weight decay.
    num_epochs: int = 300
    learning_rate: float = 3e-3
    weight_decay: float = 1e-3
    seed: int = 0


def mlp_scores(weights: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Per-model scores, float64 [num_prompts, num_models]; batch-invariant (einsum's own loops)."""
    hidden = np.einsum("nd,hd->nh", x, weights["w1"].astype(np.float64), optimize=False) + weights["b1"]
    hidden = np.maximum(hidden, 0.0)
    return np.einsum("nh,mh->nm", hidden, weights["w2"].astype(np.float64), optimize=False) + weights["b2"]


def train_mlp(x: np.ndarray, pairs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], num_models: int,
              params: MlpParams) -> tuple[dict[str, np.ndarray], float]:
    """Fits the network to battles given both ways round.

    Args:
        x: the training prompts' (standardised) features [num_prompts, dim].
        pairs: prompt ids, first and second model ids, and the first model's outcome per battle.

    Returns:
        The weights (float32) and the final training loss.
    """
    import torch

    torch.manual_seed(params.seed)
    network = torch.nn.Sequential(torch.nn.Linear(x.shape[1], params.hidden), torch.nn.ReLU(),
                                  torch.nn.Linear(params.hidden, num_models))
    optimizer = torch.optim.Adam(network.parameters(), lr=params.learning_rate, weight_decay=params.weight_decay)
    prompt_ids, first, second, outcomes = (torch.from_numpy(np.asarray(a)) for a in pairs)
    inputs = torch.from_numpy(np.asarray(x, dtype=np.float32))
    loss = torch.tensor(0.0)
    for _ in range(params.num_epochs):
        optimizer.zero_grad()
        scores = network(inputs)
        logits = scores[prompt_ids, first] - scores[prompt_ids, second]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, outcomes)
        loss.backward()
        optimizer.step()
    layer1, layer2 = network[0], network[2]
    weights = {"w1": layer1.weight, "b1": layer1.bias, "w2": layer2.weight, "b2": layer2.bias}
    return {name: value.detach().numpy().copy() for name, value in weights.items()}, float(loss.detach())
