"""The core every family builds on: the mesh of ranks (`mesh`), the one counted layer of collectives
(`comm`, `comm_errors`), the conjugate communication regions (`regions`), where a parameter lives
(`placement`), the gradient norm over every layout (`grad_norm`), host-sync counting (`syncs`) and
the selection of module units (`units`)."""
