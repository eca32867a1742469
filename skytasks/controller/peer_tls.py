"""The old path of the pool's TLS identity, kept for code that imports it from here: it is
`skytasks.tls.pool_identity`, below the controller, so the stream seal uses it without reaching up."""

from skytasks.tls.pool_identity import PoolTLS, pool_tls

__all__ = ["PoolTLS", "pool_tls"]
