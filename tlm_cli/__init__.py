"""tlm_cli: the ``tlm-convert`` command (tlm_cli.convert) and the ``tlm`` group (tlm_cli.main) over the Python API
of tlm_io, tlm_train and tlm_convert. The only package that prints."""

__all__ = []
