"""tlm_study: measurements over the model, its training and its conversion, above the conversion floor:
``tlm compare`` (compare.py: converted against trained from scratch and continued, over seeds) and ``tlm analyze``
(analyze.py: the residual alignment of each layer's MLP). Imports tlm, tlm_io, tlm_train and tlm_convert."""

__all__ = []
