"""split_experts' refusals, before any rank is left with a split it cannot compute."""

import pytest

from moe_qlora.model.distributed import Ranks, shard_rows
from moe_qlora.model.expert_parallel import check_every_rank_holds_experts
from moe_qlora.moe.expert_stacks import UnsupportedExpertsError


@pytest.mark.parametrize(
    ("experts", "world"), [(8, 2), (8, 3), (8, 4), (7, 4), (8, 8), (256, 8), (8, 5), (8, 6), (3, 4)]
)
def test_a_world_that_leaves_a_rank_without_an_expert_is_refused_naming_the_split(experts, world):
    """The refusal agrees with the split itself (torch.chunk's, shard_rows): refused exactly when some rank's
    range is empty, and it says how many."""
    empty = sum(len(shard_rows(experts, Ranks(rank=r, world=world))) == 0 for r in range(world))
    if empty == 0:
        check_every_rank_holds_experts("layers.0.mlp.experts", experts, world)
        return
    with pytest.raises(UnsupportedExpertsError, match=f"{experts} experts over {world} ranks leave {empty} rank"):
        check_every_rank_holds_experts("layers.0.mlp.experts", experts, world)
