"""Offline speculative decoding over cached states: the all-anchor drafter pass, the chain walk, DDTree, sampling at T > 0, expected tau, online loops, metrics."""
