"""Mixture of experts: the routed MLP layer and expert parallelism over ep (`layer`)."""
