"""The automatic B/W split (`resilient_jax.model.split`) on small stand-alone backwards."""

import jax
import jax.numpy as jnp
import numpy as np

from resilient_jax.model.split import split_backward
from resilient_jax.spec.model import REMAT
from tests.helpers import assert_close

D, H, T = 16, 64, 32  # width, hidden width, tokens


def _layer(params, x):
  """LayerNorm (scale and bias) then a dense layer with a bias: a block's typical pattern."""
  mean = x.mean(-1, keepdims=True)
  xhat = (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
  y = xhat * params["scale"] + params["bias"]
  return jnp.tanh(y @ params["kernel"] + params["b"])


def _split(fn, params, x):
  fwd, bwd = jax.fwd_and_bwd(fn, argnums=(0, 1), jitted=False)
  out, res = fwd(params, x)
  leaves, res_def = jax.tree.flatten(res)
  names = sorted(params)
  split = split_backward(
    lambda r, g: jax.tree.leaves(bwd(jax.tree.unflatten(res_def, r), g[0])),
    [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in leaves],
    [jax.ShapeDtypeStruct(out.shape, out.dtype)],
    input_outs=[len(names)],
    weight_outs=list(range(len(names))),
  )
  return split, leaves, out, names


def test_b_and_w_equal_the_backward_and_norm_gradients_are_not_deferred():
  kx, kk, kg = jax.random.split(jax.random.key(0), 3)
  params = {
    "scale": jnp.ones(D) * 1.5,
    "bias": jnp.full(D, 0.1),
    "kernel": jax.random.normal(kk, (D, H)) / 4,
    "b": jnp.zeros(H),
  }
  x = jax.random.normal(kx, (T, D))
  split, res, out, names = _split(_layer, params, x)
  g = jax.random.normal(kg, out.shape)
  dx, handover = split.backward_input([res[i] for i in split.b_residuals], [g])
  grads = split.backward_weight([res[i] for i in split.w_residuals], handover)
  _, vjp = jax.vjp(_layer, params, x)
  want_p, want_x = vjp(g)
  assert_close(dx[0], want_x)
  for name, got in zip(names, grads, strict=True):
    assert_close(got, want_p[name], err_msg=name)
  # The dense layer's weight gradient (x^T g) is deferred to W: B hands over the cotangent of
  # its pre-activation. The norm's scale and bias gradients are token reductions B computes at
  # little cost and hands over as two vectors, rather than the full-size cotangent of the
  # norm's output (T * D floats) for W to reduce. The dense layer's bias gradient (`sum(g)`)
  # is B's too: it reads `g` while B has it in cache, and W, which needs `g` for x^T g
  # anyway, reads it once.
  assert sorted(int(np.prod(v.shape)) for v in handover) == [D, D, H, T * H]
  assert {split.jaxpr.eqns[i].primitive.name for i in split._w_eqns} <= {"dot_general",
                                                                          "transpose"}
  b_dots = [split.jaxpr.eqns[i] for i in split._b_eqns
            if split.jaxpr.eqns[i].primitive.name == "dot_general"]
  w_dots = [split.jaxpr.eqns[i] for i in split._w_eqns
            if split.jaxpr.eqns[i].primitive.name == "dot_general"]
  assert len(b_dots) == 1 and len(w_dots) == 1  # dx in B, dW in W


def test_a_rematerialised_layer_recomputes_its_forward_in_b_once():
  """`jax.checkpoint` (`model.remat`) leaves one `remat` equation holding the recompute and the
  backward: the split inlines it, so B recomputes the forward once and W keeps only its own
  weight-gradient matmul (no third forward), with the same gradients and fewer residuals."""
  kx, kk, kg = jax.random.split(jax.random.key(1), 3)
  params = {"scale": jnp.ones(D), "bias": jnp.zeros(D), "kernel": jax.random.normal(kk, (D, H)),
            "b": jnp.zeros(H)}
  x = jax.random.normal(kx, (T, D))
  plain, plain_res, out, names = _split(_layer, params, x)
  split, res, _, _ = _split(jax.checkpoint(_layer), params, x)
  g = jax.random.normal(kg, out.shape)
  dx, handover = split.backward_input([res[i] for i in split.b_residuals], [g])
  grads = split.backward_weight([res[i] for i in split.w_residuals], handover)
  want_p, want_x = jax.vjp(_layer, params, x)[1](g)
  assert_close(dx[0], want_x)
  for name, got in zip(names, grads, strict=True):
    assert_close(got, want_p[name], err_msg=name)

  def dots(s, side):
    return sum(s.jaxpr.eqns[i].primitive.name == "dot_general" for i in getattr(s, side))

  assert (dots(plain, "_b_eqns"), dots(plain, "_w_eqns")) == (1, 1)
  assert (dots(split, "_b_eqns"), dots(split, "_w_eqns")) == (2, 1)  # + the recompute, in B
  nbytes = lambda leaves: sum(v.nbytes for v in leaves)  # noqa: E731
  assert nbytes(res) < nbytes(plain_res) / 2
  # `model.remat` names policies JAX has (listed apart, so a config check imports no JAX).
  assert all(hasattr(jax.checkpoint_policies, n) for n in REMAT if n not in ("none", "full"))
