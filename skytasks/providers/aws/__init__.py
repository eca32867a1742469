"""provider="aws": EC2 instances the pool launches, reaches over SSH, and always terminates.

`spec.py` (its fields and spec), `provider.py` (launch), `plan.py` (what to launch), `resources.py`
(tagged resources and teardown), `bootstrap.py` (the node's user-data), `watchdog.py` (its
self-termination), `gc.py` (the sweep of anything left behind), `check.py` (`skytasks check`)."""

from skytasks.providers import ProviderPlugin

PLUGIN = ProviderPlugin("aws", "skytasks.providers.aws.provider:AWSProvider",
                        settings="skytasks.providers.aws.spec:AWSSettings", credentials="aws_credentials",
                        check="skytasks.providers.aws.check:run", gc="skytasks.providers.aws.gc:command")
