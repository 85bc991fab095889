"""One path layer for the package: local folders, Cloud Storage (``gs://``) and S3 (``s3://``).

Every module that reads, writes, lists or deletes something on a run path (a workdir, a report folder,
a data cache, a token store) asks this package; nothing else calls ``open``, ``os.path``, ``os.rename``
or ``shutil`` on such a path. Paths stay plain strings: a local path (made absolute) or a URL
``gs://bucket/prefix`` / ``s3://bucket/prefix``. Callers write ``from tieflax import storage`` and
``storage.read_text(...)``: the names below are the layer's face, whatever module holds them.

The atomicity policy is chosen here, once, per kind of storage:

* Whole objects only. ``write_bytes`` on a local path writes a temporary file beside the target and
  renames it (a reader never sees half a file); on an object store one PUT is atomic already, and there
  is no rename to use.
* No appends: object stores have none (gcsfs silently ignores append mode), so logs are written as
  immutable segments (see ``tieflax.run.metrics``).
* ``create_new`` writes an object only if it does not exist yet (``O_EXCL`` locally, a generation
  precondition on Cloud Storage and S3): the primitive behind ``config.json``'s claim on a prefix and
  the lease (``tieflax.storage.lease``).

Objects go through tensorstore's key-value store of their bucket (``kvstore_spec``; the same library that
writes orbax's and the token store's arrays), which speaks the Cloud Storage JSON API and S3 directly:
one request per call, no client-side cache, generations for compare-and-set. Orbax itself takes the same
URL strings (etils.epath with gcsfs / s3fs underneath, for its metadata files).

Credentials are the libraries' own: application default credentials for Cloud Storage, the AWS
credential chain for S3. Test servers are found through the
standard variables (``STORAGE_EMULATOR_HOST`` for gcsfs; ``TENSORSTORE_GCS_HTTP_URL`` for tensorstore;
``AWS_ENDPOINT_URL`` for S3).

Modules, bottom to top: ``paths`` (names: resolve, join, a URL's bucket and key), ``failures`` (why a
remote call failed, in one line), ``deadlines`` (every remote call's deadline, the settings, the
watchdog), ``buckets`` (each bucket's tensorstore key-value store), ``files`` (whole files and objects:
read, write, list, delete, move), ``conditional`` (create-only and compare-and-set writes), ``lease`` (the
compare-and-set lease with a heartbeat, and the local lock file; imported as ``tieflax.storage.lease``).
"""

from tieflax.storage.paths import (REMOTE_SCHEMES, StorageError, bucket_and_key, is_remote, join, kvstore_spec,
                                   name, parent, refuse_url_typo, resolve)
from tieflax.storage.failures import causes, is_no_answer, object_named_in
from tieflax.storage.deadlines import (CHECKPOINT_DEADLINE_ENV, COLLECTIVE_DEADLINE_ENV, DEADLINE_ENV,
                                       DEFAULT_CHECKPOINT_DEADLINE_S, DEFAULT_COLLECTIVE_DEADLINE_S,
                                       DEFAULT_DEADLINE_S, check_deadline_settings,
                                       checkpoint_deadline_seconds, collective_deadline_seconds, deadline_seconds,
                                       deadline_within, no_answer, seconds_setting, stop_at_once, watchdog)
from tieflax.storage.buckets import forget_listings
from tieflax.storage.files import (check_writable, delete, exists, glob, is_dir, is_file, listdir, local_copy,
                                   makedirs, move_tree, read_bytes, read_many, read_text, rmtree, upload_file,
                                   walk_files, write_bytes, write_text)
from tieflax.storage.conditional import ObjectStamp, compare_and_set, create_new, read_with_stamp

# For the tests, which read the one and clear the other: the deadline of the remote call this thread is in,
# and the buckets' stores opened.
from tieflax.storage.deadlines import _DEADLINE as _DEADLINE
from tieflax.storage.buckets import _BUCKETS as _BUCKETS

__all__ = ["CHECKPOINT_DEADLINE_ENV", "COLLECTIVE_DEADLINE_ENV", "DEADLINE_ENV", "DEFAULT_CHECKPOINT_DEADLINE_S",
           "DEFAULT_COLLECTIVE_DEADLINE_S", "DEFAULT_DEADLINE_S", "REMOTE_SCHEMES", "ObjectStamp", "StorageError",
           "bucket_and_key", "causes", "check_deadline_settings", "check_writable", "checkpoint_deadline_seconds",
           "collective_deadline_seconds", "compare_and_set", "create_new", "deadline_seconds", "deadline_within",
           "delete", "exists", "forget_listings", "glob", "is_dir", "is_file", "is_no_answer", "is_remote", "join",
           "kvstore_spec", "listdir", "local_copy", "makedirs", "move_tree", "name", "no_answer", "object_named_in",
           "parent", "read_bytes", "read_many", "read_text", "read_with_stamp", "refuse_url_typo", "resolve",
           "rmtree", "seconds_setting", "stop_at_once", "upload_file", "walk_files", "watchdog", "write_bytes",
           "write_text"]
