"""FP8 training with delayed scaling (TransformerEngine's rule, compile-safe), current scaling, rowwise scaling
(torchao's) or 1 x 128 / 128 x 128 block scaling (DeepSeek-V3's).

    model = convert_to_fp8(model, DelayedScaling())   # nn.Linear -> Fp8Linear, same parameters
    loss = model(x).sum(); loss.backward(); optimizer.step()
    fp8_step(model)                                   # one all-reduce of every amax, new scales

``recipe`` (DelayedScaling, CurrentScaling, RowwiseScaling, BlockScaling), ``blockwise`` (the last two's linear), ``scaling`` (the scale rule), ``state`` (Fp8State: a module's
recipe, amax history and scales), ``linear`` (Fp8Linear and ``fp8_linear``), ``convert`` (convert_to_fp8,
fp8_step), ``fsdp`` (FSDP2 all-gathering the weights in fp8: ``convert_to_fp8(..., fp8_all_gather=True)``).
``ColumnParallelLinear`` and ``RowParallelLinear`` carry the same state once converted.
"""

from torchdist_ext.fp8.convert import convert_to_fp8, fp8_modules, fp8_step
from torchdist_ext.fp8.linear import Fp8Linear, fp8_linear
from torchdist_ext.fp8.recipe import BlockScaling, CurrentScaling, DelayedScaling, RowwiseScaling
from torchdist_ext.fp8.scaling import FP8_MAX, current_scale, update_delayed_scales_
from torchdist_ext.fp8.state import ROLES, Fp8State

__all__ = [
    "FP8_MAX",
    "ROLES",
    "BlockScaling",
    "CurrentScaling",
    "DelayedScaling",
    "Fp8Linear",
    "Fp8State",
    "RowwiseScaling",
    "convert_to_fp8",
    "current_scale",
    "fp8_linear",
    "fp8_modules",
    "fp8_step",
    "update_delayed_scales_",
]
