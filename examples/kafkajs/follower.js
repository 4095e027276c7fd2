// Follows the model topic (docs/contract.md §7, §7.1) with kafkajs and holds the newest verified serving policy.
'use strict';

const c = require('./contract');

const CHUNK = /^(\d+)\/(\d+)$/; // after "{policy}/": a full snapshot's chunk "{version}/{i}"
const DELTA_CHUNK = /^delta\/(\d+)\/(\d+)$/; // a delta's chunk "delta/{version}/{i}"

class ModelFollower {
  // kafka: a kafkajs Kafka; topic: "<prefix>policy-checkpoints"; group: a consumer group of this process alone.
  constructor({ kafka, topic, policy, group, log }) {
    Object.assign(this, { kafka, topic, policy, group, log: log || (() => {}) });
    this.chunks = new Map(); // "v/i" or "delta/v/i" -> Buffer
    this.manifests = new Map(); // version -> serving manifest (full or delta), by the readers' rules
    this.epoch = 0; // the newest valid claim or manifest epoch seen
    this.claimWriter = null; // the writer of the newest claim
    this.newestAccepted = null;
    this.caughtUp = false;
    this.current = null; // {manifest, tensors, link}: the policy served now
    this.waiters = [];
    this.deltasLoaded = 0;
  }

  async start() {
    // kafkajs has no manual assignment: a group of our own, read from the beginning, nothing committed.
    // The topic has one partition, so this group's only member reads all of it on every start.
    // A group of one: the shortest session brokers allow by default (6 s) makes joining quick (the embedded
    // broker answers a join after about half the session timeout: 15 s at kafkajs's default of 30 s).
    this.consumer = this.kafka.consumer({
      groupId: this.group,
      allowAutoTopicCreation: false,
      sessionTimeout: 6000,
      heartbeatInterval: 2000,
    });
    await this.consumer.connect();
    await this.consumer.subscribe({ topic: this.topic, fromBeginning: true });
    await this.consumer.run({
      autoCommit: false,
      eachBatch: async ({ batch }) => {
        for (const msg of batch.messages) this.observe(msg.key, msg.value);
        // Caught up when the position reaches the high watermark returned with this fetch.
        const last = batch.messages.length ? BigInt(batch.messages[batch.messages.length - 1].offset) : -1n;
        if (last + 1n >= BigInt(batch.highWatermark)) this.caughtUp = true;
        if (this.caughtUp) this.refresh();
      },
    });
  }

  async stop() {
    if (this.consumer) await this.consumer.disconnect();
    this.consumer = null;
  }

  // Resolves with the policy once one of at least `minVersion` is loaded (after catching up), else rejects.
  loaded(timeoutMs, minVersion = 1) {
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`no verified serving checkpoint within ${timeoutMs} ms`)),
        timeoutMs);
      this.waiters.push({ minVersion, done: (p) => { clearTimeout(timer); resolve(p); } });
      this.notify();
    });
  }

  notify() {
    if (!this.current) return;
    this.waiters = this.waiters.filter((w) => {
      if (this.current.manifest.version < w.minVersion) return true;
      w.done(this.current);
      return false;
    });
  }

  observe(keyBuf, value) {
    const key = keyBuf ? keyBuf.toString('utf8') : '';
    const p = this.policy;
    if (key === `${p}/epoch`) return this.claim(value);
    if (key === p) return this.manifest(value, 'policy_checkpoint/v1');
    if (key === `${p}/delta`) return this.manifest(value, 'policy_delta/v1');
    if (!key.startsWith(`${p}/`)) return undefined; // another policy's
    const rest = key.slice(p.length + 1);
    const m = CHUNK.exec(rest) || DELTA_CHUNK.exec(rest);
    if (!m) return undefined; // candidates, the canary, slot-map records: not followed here
    if (this.manifests.has(Number(m[1]))) return undefined; // chunks after their manifest: a fenced writer's
    if (value === null) this.chunks.delete(rest); // a tombstone
    else this.chunks.set(rest, value);
    return undefined;
  }

  claim(value) {
    if (value === null) return;
    try {
      const obj = JSON.parse(value.toString('utf8'));
      if (obj.schema === 'writer_epoch/v1' && Number.isInteger(obj.epoch) && obj.epoch > this.epoch) {
        this.epoch = obj.epoch;
        this.claimWriter = obj.writer;
      }
    } catch (err) {
      this.log(`epoch claim ignored: ${err.message}`);
    }
  }

  manifest(value, schema) {
    if (value === null) return;
    let m;
    try {
      m = JSON.parse(value.toString('utf8'));
    } catch (err) {
      this.log(`manifest ignored: not JSON (${err.message})`);
      return;
    }
    const problems = m.schema === schema && m.policy === this.policy ? c.checkManifest(m, this.newestAccepted) : [
      'schema or policy'];
    const epoch = Number.isInteger(m.epoch) ? m.epoch : 0;
    const writer = (m.metrics || {}).writer;
    if (epoch < this.epoch) problems.push(`epoch ${epoch} below ${this.epoch}`);
    if (epoch === this.epoch && this.claimWriter !== null && writer !== this.claimWriter) problems.push('fenced writer');
    if (problems.length) {
      this.log(`manifest v${m.version} ignored: ${problems.join(', ')}`);
      return;
    }
    this.epoch = epoch;
    this.manifests.set(m.version, m);
    this.newestAccepted = Math.max(this.newestAccepted ?? 0, m.version);
  }

  blob(m) {
    const prefix = m.schema === 'policy_delta/v1' ? `delta/${m.version}` : `${m.version}`;
    const parts = [];
    for (let i = 0; i < m.chunks; i++) {
      const part = this.chunks.get(`${prefix}/${i}`);
      if (!part) throw new Error(`missing chunk ${i} of v${m.version}`);
      parts.push(part);
    }
    return Buffer.concat(parts);
  }

  // A full snapshot (§7) or, for a delta, the chain back to one (§7.1): the state and its link id.
  build(m) {
    if (m.schema === 'policy_checkpoint/v1') return { manifest: m, tensors: c.verifyBlob(this.blob(m), m), link: m.sha256 };
    let base;
    if (this.current && this.current.manifest.version === m.base_version && this.current.link === m.base_sha256) {
      base = this.current;
    } else {
      const prev = this.manifests.get(m.base_version);
      if (!prev || prev.sha256 !== m.base_sha256) throw new Error(`v${m.version}: base v${m.base_version} missing`);
      base = this.build(prev);
    }
    const blob = this.blob(m);
    if (blob.length !== m.size || c.sha256Hex(blob) !== m.sha256) throw new Error(`v${m.version}: delta size or sha256`);
    const tensors = c.applyDelta(base.tensors, blob, m.base_sha256, m.arch);
    if (c.sha256Hex(c.fullSnapshotBytes(tensors)) !== m.state_sha256) throw new Error(`v${m.version}: state_sha256`);
    this.deltasLoaded += 1;
    return { manifest: m, tensors, link: m.sha256 };
  }

  // Load the newest serving version above the current one that verifies; keep the current policy otherwise.
  refresh() {
    const newer = [...this.manifests.keys()].filter((v) => !this.current || v > this.current.manifest.version);
    for (const v of newer.sort((a, b) => b - a)) {
      try {
        this.current = this.build(this.manifests.get(v));
        this.log(`loaded v${v} (${this.current.manifest.reason})`);
        break;
      } catch (err) {
        this.log(`v${v} not loaded: ${err.message}`);
      }
    }
    this.notify();
  }
}

module.exports = { ModelFollower };
