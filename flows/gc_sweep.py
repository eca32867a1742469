"""A Prefect flow around `skytasks gc`, to deploy on a schedule (see deployments/prefect.yaml)."""

from __future__ import annotations

from datetime import datetime

from prefect import flow, get_run_logger
from prefect_aws import AwsCredentials

from skytasks.providers.aws.gc import sweep


@flow(name="skytasks-gc", log_prints=True)
def skytasks_gc(aws_credentials_block: str | None = None, grace_minutes: float = 15, dry_run: bool = False,
                now: datetime | None = None) -> list[str]:
    """Delete the EC2 resources of aws pools that are expired or orphaned; returns their ids.
    `now`: sweep as of this time (a dry run of what a later sweep would delete)."""
    credentials = AwsCredentials.load(aws_credentials_block) if aws_credentials_block else AwsCredentials()
    logger = get_run_logger()
    return sweep(credentials.get_client("ec2"), now=now, grace_minutes=grace_minutes, dry_run=dry_run, log=logger.info)


if __name__ == "__main__":
    skytasks_gc()
