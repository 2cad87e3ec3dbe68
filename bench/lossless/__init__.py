"""Losslessness of sampled output, proved: the engine's sampled sequences against the exact
distribution of a tiny target, for every drafter, tree shape, lookahead, warp and deployment."""
