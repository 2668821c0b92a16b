"""The online-softmax step shared by the decode kernels (flash-decoding's running max, running
sum and weighted accumulator over one tile of keys)."""
import triton
import triton.language as tl


@triton.jit
def online_softmax_step(scores, values, running_max, running_sum, acc):
    """Fold a tile's scores [T] and values [T, D] into (max, sum, acc [D])."""
    new_max = tl.maximum(running_max, tl.max(scores, axis=0))
    weights = tl.exp(scores - new_max)
    correction = tl.exp(running_max - new_max)
    running_sum = running_sum * correction + tl.sum(weights, axis=0)
    acc = acc * correction + tl.sum(weights[:, None] * values, axis=0)
    return new_max, running_sum, acc
