"""Evolution library for PopuLoRA: LoRA weight-space operators, TrueSkill ratings,
PFSP matchmaking and selection. Pure torch/numpy/trueskill: never imports Ray or ``driver``.
"""

from evolution.lora_pairs import LoraPair, adapter_rank, delta_weights, layer_index, lora_pairs
from evolution.operators import CROSSOVERS, DEFAULT_PARAMS, MUTATIONS, OPERATORS, num_parents
from evolution.pfsp import match, weights
from evolution.ratings import Ratings
from evolution.selection import choose_operator, tournament, weakest

__all__ = [
    "CROSSOVERS",
    "DEFAULT_PARAMS",
    "MUTATIONS",
    "OPERATORS",
    "LoraPair",
    "Ratings",
    "adapter_rank",
    "choose_operator",
    "delta_weights",
    "layer_index",
    "lora_pairs",
    "match",
    "num_parents",
    "tournament",
    "weakest",
    "weights",
]
