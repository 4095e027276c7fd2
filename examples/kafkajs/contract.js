// The wire contract's math and checks (docs/contract.md §6, §7, §7.1), written from the contract alone.
// Pure functions over Buffers and plain arrays: no Kafka here (client.js does the I/O).
'use strict';

const crypto = require('node:crypto');

const TENSORS = ['norm.weight', 'norm.bias', 'hidden.weight', 'hidden.bias', 'out.weight', 'out.bias', 'alpha'];
const MAX_CHUNK_BYTES = 512 * 1024; // §7: every chunk holds at most 512 KiB
const MIN_CHUNK_BYTES = 1024; // §7: every chunk but the last holds at least 1 KiB
const HEADER_ALLOWANCE = 1024 * 1024; // §7: size may exceed the tensors' bytes by at most 1 MiB
const MAX_BLOB_BYTES = 32 * 1024 ** 3;
const MAX_VERSION = 2 ** 53;
const MAX_VERSION_JUMP = 1_000_000;
// §7 `reason`. This client serves no incumbent (1.17) and so takes no probe (1.19): a reason it does
// not know is out of range, and it keeps serving what it holds.
const REASONS = ['init', 'periodic', 'reset', 'label', 'shutdown', 'rollback', 'cutover', 'suppress'];
// §7 "serving": what a manifest without `serving` (or without one of its keys) means.
const SERVING_DEFAULTS = {
  temperature: 0.05,
  explore_rate: 0.1,
  explore_temperature: 0.25,
  drop: 'dynamic',
  drop_ratio: 0.01,
  canary_rate: 0,
};

function sha256Hex(buf) {
  return crypto.createHash('sha256').update(buf).digest('hex');
}

// The shapes `arch` implies (§7's tensor table).
function shapes(arch) {
  const d = arch.embedding_dim;
  const h = arch.hidden;
  const s = arch.slots;
  return {
    'norm.weight': [d],
    'norm.bias': [d],
    'hidden.weight': [h, d + 2],
    'hidden.bias': [h],
    'out.weight': [s, h],
    'out.bias': [s],
    alpha: [1],
  };
}

// safetensors: u64 little-endian header length N, N bytes of JSON header, then the data.
function parseSafetensors(buf) {
  if (buf.length < 8) throw new Error('unreadable: shorter than a safetensors header');
  const n = Number(buf.readBigUInt64LE(0));
  if (8 + n > buf.length) throw new Error('unreadable: header runs past the blob');
  const header = JSON.parse(buf.subarray(8, 8 + n).toString('utf8'));
  const data = buf.subarray(8 + n);
  const out = { metadata: header.__metadata__ || {}, tensors: {} };
  for (const [name, info] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    const [begin, end] = info.data_offsets;
    if (!(begin >= 0 && begin <= end && end <= data.length)) throw new Error(`unreadable: ${name} offsets`);
    const bytes = data.subarray(begin, end);
    let values;
    if (info.dtype === 'F32') {
      values = new Float32Array(bytes.length / 4);
      for (let i = 0; i < values.length; i++) values[i] = bytes.readFloatLE(4 * i);
    } else if (info.dtype === 'I64') {
      values = [];
      for (let i = 0; i < bytes.length / 8; i++) values.push(Number(bytes.readBigInt64LE(8 * i)));
    } else {
      values = null;
    }
    out.tensors[name] = { dtype: info.dtype, shape: info.shape, values };
  }
  return out;
}

function sameShape(a, b) {
  return a.length === b.length && a.every((x, i) => x === b[i]);
}

// The byte layout of a full snapshot (§7, "state_sha256"): what a delta's state_sha256 hashes.
function fullSnapshotBytes(tensors) {
  const names = [...TENSORS].sort(); // all float32: ordered by name
  let offset = 0;
  const entries = [];
  for (const name of names) {
    const t = tensors[name];
    const end = offset + 4 * t.values.length;
    entries.push(`"${name}":{"dtype":"F32","shape":[${t.shape.join(',')}],"data_offsets":[${offset},${end}]}`);
    offset = end;
  }
  let header = `{${entries.join(',')}}`;
  header += ' '.repeat((8 - (Buffer.byteLength(header) % 8)) % 8); // padded with spaces to a multiple of 8
  const head = Buffer.alloc(8);
  head.writeBigUInt64LE(BigInt(Buffer.byteLength(header)));
  const data = Buffer.alloc(offset);
  let at = 0;
  for (const name of names) {
    for (const v of tensors[name].values) at = data.writeFloatLE(v, at);
  }
  return Buffer.concat([head, Buffer.from(header, 'utf8'), data]);
}

// Readers' rules (§7): bounds a manifest must satisfy before a reader follows it.
function checkManifest(m, newestAccepted) {
  const problems = [];
  if (!Number.isInteger(m.version) || m.version < 0 || m.version > MAX_VERSION) problems.push('version out of range');
  if (newestAccepted !== null && m.version > newestAccepted + MAX_VERSION_JUMP) problems.push('version jump');
  if (!REASONS.includes(m.reason)) problems.push(`reason ${JSON.stringify(m.reason)} out of range`);
  const a = m.arch || {};
  if (a.input_dim !== a.embedding_dim + 2) problems.push('arch.input_dim != embedding_dim + 2');
  const params = 2 * a.embedding_dim + a.hidden * (a.embedding_dim + 2) + a.hidden + a.slots * a.hidden + a.slots + 1;
  const maxSize = Math.min(4 * params + HEADER_ALLOWANCE, MAX_BLOB_BYTES);
  if (!Number.isInteger(m.size) || m.size < 1 || m.size > maxSize) problems.push('size out of range');
  const maxChunks = Math.max(1, Math.ceil(m.size / MIN_CHUNK_BYTES));
  if (!Number.isInteger(m.chunks) || m.chunks < Math.ceil(m.size / MAX_CHUNK_BYTES) || m.chunks > maxChunks) {
    problems.push('chunks out of range');
  }
  if (!/^[0-9a-f]{64}$/.test(m.sha256 || '')) problems.push('sha256 is not 64 lowercase hex digits');
  return problems;
}

// "Verify before use" (§7): length, sha256, safetensors, every tensor float32, finite, of arch's shape.
function verifyBlob(blob, manifest) {
  if (blob.length !== manifest.size) throw new Error(`size_mismatch: ${blob.length} != ${manifest.size}`);
  if (sha256Hex(blob) !== manifest.sha256) throw new Error('sha256_mismatch');
  const parsed = parseSafetensors(blob);
  const want = shapes(manifest.arch);
  const tensors = {};
  for (const name of TENSORS) {
    const t = parsed.tensors[name];
    if (!t) throw new Error(`missing_tensor: ${name}`);
    if (t.dtype !== 'F32') throw new Error(`wrong_dtype: ${name} is ${t.dtype}`);
    if (!sameShape(t.shape, want[name])) throw new Error(`arch_mismatch: ${name} [${t.shape}] != [${want[name]}]`);
    if (!t.values.every(Number.isFinite)) throw new Error(`non_finite: ${name}`);
    tensors[name] = t;
  }
  return tensors;
}

// §7.1: a delta blob applied to a state (returns a new state); the caller checks size and sha256 first.
function applyDelta(state, deltaBlob, baseSha256, arch) {
  const d = parseSafetensors(deltaBlob);
  if (d.metadata.base_sha256 !== baseSha256) throw new Error('delta base_sha256 differs from the manifest');
  const rows = d.tensors.rows.values;
  const h = arch.hidden;
  for (let i = 0; i < rows.length; i++) {
    if (!(rows[i] >= 0 && rows[i] < arch.slots && (i === 0 || rows[i] > rows[i - 1]))) throw new Error('bad rows');
  }
  const next = {};
  for (const name of TENSORS) next[name] = { ...state[name], values: Float32Array.from(state[name].values) };
  for (const name of ['norm.weight', 'norm.bias', 'hidden.weight', 'hidden.bias', 'alpha']) {
    const t = d.tensors[name];
    if (!t || !sameShape(t.shape, state[name].shape) || !t.values.every(Number.isFinite)) throw new Error(name);
    next[name].values = Float32Array.from(t.values);
  }
  const w = d.tensors['out.weight.rows'].values;
  const b = d.tensors['out.bias.rows'].values;
  if (w.length !== rows.length * h || b.length !== rows.length) throw new Error('delta rows shape');
  if (!w.every(Number.isFinite) || !b.every(Number.isFinite)) throw new Error('non_finite: delta rows');
  rows.forEach((r, i) => {
    next['out.weight'].values.set(w.subarray(i * h, (i + 1) * h), r * h);
    next['out.bias'].values[r] = b[i];
  });
  return next;
}

// erf to ~1e-15: the series below 2.5, the continued fraction of erfc above (exact GELU needs erf).
function erf(x) {
  const ax = Math.abs(x);
  if (ax < 2.5) {
    let term = x;
    let sum = x;
    for (let n = 1; n < 200; n++) {
      term *= (-x * x) / n;
      const add = term / (2 * n + 1);
      sum += add;
      if (Math.abs(add) < 1e-17 * Math.abs(sum)) break;
    }
    return (2 / Math.sqrt(Math.PI)) * sum;
  }
  let f = 0;
  for (let n = 60; n >= 1; n--) f = n / 2 / (ax + f);
  const erfc = Math.exp(-ax * ax) / Math.sqrt(Math.PI) / (ax + f);
  return Math.sign(x) * (1 - erfc);
}

function softplus(x) {
  return x > 20 ? x : Math.log1p(Math.exp(x));
}

// m = softplus(out(gelu(hidden([layernorm(q); last_step_loss; last_step_entropy])))) for the given slots (§7).
function masks(tensors, q, loss, entropy, slots) {
  const d = q.length;
  const mean = q.reduce((a, b) => a + b, 0) / d;
  const variance = q.reduce((a, b) => a + (b - mean) ** 2, 0) / d; // biased variance
  const x = q.map((v, i) => ((v - mean) / Math.sqrt(variance + 1e-5)) * tensors['norm.weight'].values[i] +
    tensors['norm.bias'].values[i]);
  x.push(loss, entropy);
  const [hidden, inputs] = tensors['hidden.weight'].shape;
  const hw = tensors['hidden.weight'].values;
  const hb = tensors['hidden.bias'].values;
  const g = new Float64Array(hidden);
  for (let j = 0; j < hidden; j++) {
    let a = hb[j];
    for (let i = 0; i < inputs; i++) a += hw[j * inputs + i] * x[i];
    g[j] = 0.5 * a * (1 + erf(a / Math.SQRT2)); // exact (erf) GELU
  }
  const ow = tensors['out.weight'].values;
  const ob = tensors['out.bias'].values;
  return slots.map((s) => {
    let a = ob[s];
    for (let j = 0; j < hidden; j++) a += ow[s * hidden + j] * g[j];
    return softplus(a);
  });
}

// §6 step 3: the hard drop. `drop` as the manifest's serving says: dynamic, fixed or none.
function keepFlags(m, serving) {
  if (serving.drop === 'none' || m.length === 0) return m.map(() => true);
  const threshold = serving.drop === 'fixed' ? serving.drop_ratio : serving.drop_ratio * Math.max(...m);
  return m.map((v) => !(v < threshold));
}

function logits(scores, m, alpha, temperature) {
  return scores.map((s, i) => (s * (1 + alpha * m[i])) / temperature);
}

function logsumexp(values) {
  const top = Math.max(...values);
  return top + Math.log(values.reduce((a, v) => a + Math.exp(v - top), 0));
}

// §6 step 5: log π(order) under Plackett–Luce over z; `order` are positions into z.
function plackettLuceLogprob(z, order) {
  let left = z.map((_, i) => i);
  let lp = 0;
  for (const p of order) {
    lp += z[p] - logsumexp(left.map((i) => z[i]));
    left = left.filter((i) => i !== p);
  }
  return lp;
}

// Draw k positions in order without replacement from softmax(z): Gumbel-top-k.
function samplePlackettLuce(z, k, random) {
  const keyed = z.map((v, i) => [v - Math.log(-Math.log(random())), i]);
  keyed.sort((a, b) => b[0] - a[0]);
  return keyed.slice(0, Math.min(k, z.length)).map(([, i]) => i);
}

// A manifest's serving parameters, its missing keys (or a missing `serving`) taking §7's defaults.
function servingOf(manifest) {
  return { ...SERVING_DEFAULTS, ...(manifest.serving || {}) };
}

module.exports = {
  TENSORS,
  SERVING_DEFAULTS,
  sha256Hex,
  parseSafetensors,
  fullSnapshotBytes,
  checkManifest,
  verifyBlob,
  applyDelta,
  masks,
  keepFlags,
  logits,
  plackettLuceLogprob,
  samplePlackettLuce,
  servingOf,
  erf,
};
