"""model/tokenizer.gguf_metadata reads a GGUF file's metadata exactly as the gguf package's
reader does: every value type (scalars, strings, numeric and string arrays, nested arrays kept
nested) on a
file written by gguf's own writer; and a file that is not GGUF, or of an unknown version, is
refused naming what it is."""
import gguf
import numpy as np
import pytest

from pagedjax.model.tokenizer import gguf_metadata


def test_every_value_type_reads_as_the_gguf_reader_reads_it(tmp_path):
  path = str(tmp_path / 'meta.gguf')
  writer = gguf.GGUFWriter(path, 'llama')
  writer.add_uint8('t.u8', 200)
  writer.add_int8('t.i8', -100)
  writer.add_uint16('t.u16', 60000)
  writer.add_int16('t.i16', -30000)
  writer.add_uint32('t.u32', 4_000_000_000)
  writer.add_int32('t.i32', -2_000_000_000)
  writer.add_float32('t.f32', 0.1)
  writer.add_uint64('t.u64', 2**63 + 5)
  writer.add_int64('t.i64', -2**62)
  writer.add_float64('t.f64', 1e-300)
  writer.add_bool('t.bool', True)
  writer.add_string('t.str', 'ünïcode <|im_end|>')
  writer.add_array('t.strs', ['a', '', 'Ġthe', '<|im_start|>'])
  writer.add_array('t.ints', [1, -2, 3])
  writer.add_array('t.floats', [0.5, -1.25])
  writer.add_array('t.nested', [[1, 2], [3]])
  writer.add_tensor('w', np.zeros((2, 3), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()

  ours = gguf_metadata(path)
  reader = gguf.GGUFReader(path)
  theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith('GGUF.')}
  # gguf's contents() flattens an array of arrays; ours keeps the nesting the file has.
  assert ours.pop('t.nested') == [[1, 2], [3]] and theirs.pop('t.nested') == [1, 2, 3]
  assert ours == theirs
  assert ours['t.strs'] == ['a', '', 'Ġthe', '<|im_start|>'] and ours['t.u64'] == 2**63 + 5


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
  path = tmp_path / 'not.gguf'
  path.write_bytes(b'PK\x03\x04' + bytes(40))
  with pytest.raises(ValueError, match="not a GGUF file"):
    gguf_metadata(str(path))
  path.write_bytes(b'GGUF' + (9).to_bytes(4, 'little') + bytes(16))
  with pytest.raises(ValueError, match='GGUF version 9; supported: 2, 3'):
    gguf_metadata(str(path))
