"""``ObjectiveAudit`` and what it reports, as :mod:`lightning_weighted.trainer.audit` defines them."""

from lightning_weighted.trainer.audit import AuditReport, ObjectiveAudit, ObjectiveMismatchError, is_audit_rerun

__all__ = ["AuditReport", "ObjectiveAudit", "ObjectiveMismatchError", "is_audit_rerun"]
