"""EC2: launch (`provider`), what to launch (`plan`), tagged resources and teardown
(`resources`), the node's user-data (`bootstrap`), its self-termination (`watchdog`) and the
sweep of anything left behind (`gc`)."""

from skytasks.providers.aws.provider import AWSProvider

__all__ = ["AWSProvider"]
