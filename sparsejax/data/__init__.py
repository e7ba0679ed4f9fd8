"""The host input pipeline: readers (Criteo TSV, delimited text with a schema, libSVM /
libFM, Parquet; plain, gzip or zstd; one file, a glob or a list), label rules, a
synthetic Zipf generator, id mappings, an in-memory columnar store, a resumable
streaming `FileSource` for files larger than memory, and the prefetching, resumable
`Loader` that packs everything into fixed-shape `SparseBatch`es.

Two forms of a feature's ids: `JaggedIds` on the host (lengths + values, as TorchRec's
`JaggedTensor`), and `PaddedIds` on the device (ids + segments padded to a fixed
capacity, what `SparseBatch.features` holds). The old names `Ragged` (= `JaggedIds`) and
`Jagged` (= `PaddedIds`) still work for one release and warn.
"""

from .._deprecation import alias_getattr as _alias_getattr
from ._batch import BatchPacker as BatchPacker
from ._batch import JaggedIds as JaggedIds
from ._batch import PaddedIds as PaddedIds
from ._batch import SparseBatch as SparseBatch
from ._behavior import SyntheticBehavior as SyntheticBehavior
from ._criteo import CATEGORICAL_NAMES as CATEGORICAL_NAMES
from ._criteo import DENSE_NAMES as DENSE_NAMES
from ._criteo import CriteoParser as CriteoParser
from ._criteo import HashMapping as HashMapping
from ._criteo import RawIdMapping as RawIdMapping
from ._criteo import VocabMapping as VocabMapping
from ._criteo import fit_vocab as fit_vocab
from ._criteo import specs_for_vocab as specs_for_vocab
from ._criteo import vocab_sizes as vocab_sizes
from ._csv import MISSING as MISSING
from ._csv import DelimitedParser as DelimitedParser
from ._csv import ParseErrors as ParseErrors
from ._csv import ParseReport as ParseReport
from ._csv import TableSchema as TableSchema
from ._csv import open_text as open_text
from ._csv import stable_hash as stable_hash
from ._event_config import EventLogError as EventLogError
from ._event_config import SequenceConfig as SequenceConfig
from ._events import EventLog as EventLog
from ._events import read_events as read_events
from ._events import synthetic_events as synthetic_events
from ._files import DataFileError as DataFileError
from ._files import delimited_header as delimited_header
from ._files import expand_files as expand_files
from ._files import first_line as first_line
from ._files import open_file as open_file
from ._files import shard_files as shard_files
from ._files import starts_with_header as starts_with_header
from ._labels import LabelError as LabelError
from ._labels import LabelRule as LabelRule
from ._loader import BatchSource as BatchSource
from ._loader import Examples as Examples
from ._loader import HostBatch as HostBatch
from ._loader import Loader as Loader
from ._loader import LoaderPosition as LoaderPosition
from ._loader import measure_throughput as measure_throughput
from ._loader import pack_examples as pack_examples
from ._loader import resplit_stream_positions as resplit_stream_positions
from ._prepared import PreparedData as PreparedData
from ._prepared import PreparedDataError as PreparedDataError
from ._prepared import write_prepared as write_prepared
from ._readers import iter_criteo_chunks as iter_criteo_chunks
from ._readers import read_criteo as read_criteo
from ._readers import read_delimited as read_delimited
from ._readers import read_libsvm as read_libsvm
from ._readers import read_parquet as read_parquet
from ._sequences import HISTORY as HISTORY
from ._sequences import ITEM as ITEM
from ._sequences import CandidateSets as CandidateSets
from ._sequences import SequenceData as SequenceData
from ._sequences import SequenceReport as SequenceReport
from ._sequences import build_sequences as build_sequences
from ._sequences import load_sequences as load_sequences
from ._sequences import popularity_scores as popularity_scores
from ._stream import FORMATS as FORMATS
from ._stream import Chunk as Chunk
from ._stream import FileSource as FileSource
from ._stream import StreamPosition as StreamPosition
from ._synthetic import KAGGLE_CARDINALITIES as KAGGLE_CARDINALITIES
from ._synthetic import SyntheticCriteo as SyntheticCriteo
from ._text import stable_hash_bytes as stable_hash_bytes
from ._transforms import ColumnTransform as ColumnTransform
from ._transforms import Join as Join
from ._transforms import JoinKeyError as JoinKeyError
from ._transforms import SideTable as SideTable
from ._transforms import indicator_bag as indicator_bag

_DEPRECATED = {"Jagged": PaddedIds, "Ragged": JaggedIds}


# Deprecated aliases (one release): the old names read wrong to a TorchRec user.
__getattr__ = _alias_getattr(__name__, _DEPRECATED)
