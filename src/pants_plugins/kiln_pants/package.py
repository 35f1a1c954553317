"""`pants package` for artifacts: the hermetic path. Everything runs as cached Pants processes, so
a local or remote cache serves a built artifact to a clean machine; the result lands in dist/."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pants.core.goals.package import BuiltPackage, BuiltPackageArtifact, PackageFieldSet
from pants.engine.addresses import Addresses
from pants.engine.fs import AddPrefix, CreateDigest, Digest, FileContent
from pants.engine.rules import Get, collect_rules, rule
from pants.engine.unions import UnionRule

from kiln_pants.artifact_graph import Artifact
from kiln_pants.target_types import NumShardsField, TokenizerField
from kiln_pants.tokenize_rules import BuildCachesRequest, BuiltCaches

MANIFEST_FILE = "manifest.json"


async def store_pointer_package(artifact: Artifact, store_path: str) -> BuiltPackage:
    """The package of an artifact built into the store: a manifest pointing at it."""
    location = artifact.folder
    manifest = {"store_path": store_path, "fingerprint": artifact.fingerprint}
    digest = await Get(
        Digest,
        CreateDigest([FileContent(f"{location}/{MANIFEST_FILE}", json.dumps(manifest).encode())]),
    )
    return BuiltPackage(digest, (BuiltPackageArtifact(location),))


@dataclass(frozen=True)
class TokenizedCachePackageFieldSet(PackageFieldSet):
    required_fields = (TokenizerField, NumShardsField)

    tokenizer: TokenizerField


@rule(desc="Packaging a tokenized cache")
async def package_tokenized_cache(field_set: TokenizedCachePackageFieldSet) -> BuiltPackage:
    request = BuildCachesRequest(Addresses([field_set.address]))
    [built] = (await Get(BuiltCaches, BuildCachesRequest, request)).caches
    if built.store_path is not None:  # storage="store": the package is a pointer to it
        return await store_pointer_package(built.artifact, built.store_path)
    location = built.artifact.folder
    digest = await Get(Digest, AddPrefix(built.digest, location))
    return BuiltPackage(digest, (BuiltPackageArtifact(location),))


def rules():
    return [
        *collect_rules(),
        UnionRule(PackageFieldSet, TokenizedCachePackageFieldSet),
    ]
