"""The old path of the stream seal, kept for code that imports it from here: the seal is
`skytasks.tls.stream_seal` (its node end `skytasks.tls.seal_pump`), below both the controller and
the node side."""

from skytasks.tls.stream_seal import (SEALED_ENV, UNSEALED_FOR_TESTS, Identity, SealedEnds, SealFailed, attach_argv,
                                      identity, node_prelude, seal_controller_end, wanted)

__all__ = ["SEALED_ENV", "UNSEALED_FOR_TESTS", "Identity", "SealFailed", "SealedEnds", "attach_argv", "identity",
           "node_prelude", "seal_controller_end", "wanted"]
