"""Mixture of experts: the routed MLP layer and expert parallelism over ep (`layer`), the router with
DeepSeekMoE's options (`router`), auxiliary-loss-free bias balancing (`balance`)."""
