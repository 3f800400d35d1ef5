"""Expert parallelism: mixture-of-experts layers, whose feed-forward is a set of experts of
which each token uses a few. `router` holds the routing math (which experts a token goes to,
with what weights, the balancing losses and capacity drops) as pure functions with no
parameters and no communication, so the layer that dispatches tokens across ranks stays small.
"""
