"""CUDA's own rules, modelled so that any machine can predict what a card holds.

A card runs out of memory on the caching allocator's *reserved* segments plus what lives
outside it (the CUDA context, library workspaces), under CUDA's autocast lists and attention
kernels, none of which a CPU run shows. The modules here bring those rules to a prediction made
anywhere: the card catalogue (``cards``), the caching allocator (``allocator``) and its
snapshots (``snapshot``), standard library only, so the sweep layer may read them without
torch; and, for a CUDA target predicted on CPU kernels, CUDA's autocast policy (``autocast``)
and attention backends (``attention``).
"""
