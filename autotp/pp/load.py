"""`from_pretrained(..., pp_size=P)`: each rank reads only its own stages' decoder layers (at its TP rows).

Why before the pipeline's own step: `from_pretrained` reads the checkpoint in `autotp.parallelize`'s step 5, on a
model still on the meta device, and the pipeline cuts the model in step 8. So the layers other stages run are
replaced by pass-throughs (`autotp.pp.cut.skip_others`) just before the read, with the cut and stages the pipeline's
step takes (its own `split_plan` computes them), and the read never touches their tensors.
"""

from __future__ import annotations

from torch import nn

from ..state import TPState
from .cut import skip_others
from .dimension import PipelineParallelism


def drop_other_stages(model: nn.Module, state: TPState) -> tuple[str, ...]:
    """At pp > 1, the decoder layers this rank's stages do not run dropped from the meta model; returns their names'
    prefixes (the checkpoint tensors the read leaves out on purpose). Nothing at pp 1."""
    if state.options.pp_size == 1:
        return ()
    pipeline = PipelineParallelism()
    pipeline.split_plan(model, state.plan, state.options)  # the cut and this rank's stages, as step 8 finds them
    skip_others(model, pipeline.cut, pipeline.stages)
    return pipeline.cut.prefixes(pipeline.stages)
