"""Storage tiers, one module each, behind one interface (:class:`StorageTier`), and the URL grammar hooks build them
from (:func:`tier_from_url`)."""

from kvcodec.store.tiers.base import DEFAULT_MAX_VALUE_BYTES, StorageTier
from kvcodec.store.tiers.disk import DiskTier
from kvcodec.store.tiers.memory import GPUTier, MemoryTier
from kvcodec.store.tiers.mooncake import MooncakeTier  # imports mooncake only when a tier is built
from kvcodec.store.tiers.redis import RedisTier
from kvcodec.store.tiers.urls import OPTIONS, default_disk_folder, has_password, parse_size, redact, tier_from_url

__all__ = ["StorageTier", "MemoryTier", "GPUTier", "DiskTier", "RedisTier", "MooncakeTier", "DEFAULT_MAX_VALUE_BYTES",
           "tier_from_url", "redact", "has_password", "parse_size", "OPTIONS", "default_disk_folder"]
