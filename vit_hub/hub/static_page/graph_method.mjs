// Which map a graph's `map` output is, read from the graph itself: pipeline_explain.onnx names
// its method in the model's metadata (vit_hub.map_method, vit_hub.map_label: the method the
// Gradio page opens with for this model, written by export/gradient_graph.py); a graph without
// them (pipeline_map.onnx) draws attention rollout. ONNX Runtime's JavaScript API does not give
// a model's metadata, so it is read here from the graph's bytes: an ONNX file is one protobuf
// ModelProto, whose field 14 holds the metadata entries (key: field 1, value: field 2). One file
// for both JavaScript apps: the static Space's page.js and examples/node/classify.mjs import it.
export const ROLLOUT = { method: "rollout", label: "Attention rollout" };
const METHOD_KEY = "vit_hub.map_method";
const LABEL_KEY = "vit_hub.map_label";
const METADATA_FIELD = 14; // ModelProto.metadata_props
const utf8 = new TextDecoder();

// A protobuf message's fields: [field number, wire type, value (a number, or the bytes of a
// length-delimited field)] for each, in order. Field values other than these are not needed here.
function* fields(bytes) {
  let at = 0;
  const varint = () => {
    let value = 0;
    for (let shift = 0; ; shift += 7) {
      if (at >= bytes.length) throw new Error("graph: expected an ONNX model, found a truncated protobuf");
      const byte = bytes[at++];
      value += (byte & 0x7f) * 2 ** shift;
      if (byte < 0x80) return value;
    }
  };
  while (at < bytes.length) {
    const tag = varint();
    const [field, wire] = [Math.floor(tag / 8), tag % 8];
    if (wire === 0) yield [field, wire, varint()];
    else if (wire === 1 || wire === 5) at += wire === 1 ? 8 : 4;
    else if (wire === 2) {
      const length = varint();
      yield [field, wire, bytes.subarray(at, at + length)];
      at += length;
    } else throw new Error(`graph: expected an ONNX model, found protobuf wire type ${wire}`);
  }
}

// The graph's metadata, {key: value}, from its bytes (a Uint8Array of the .onnx file).
export function graphMetadata(bytes) {
  const entries = {};
  for (const [field, wire, value] of fields(bytes)) {
    if (field !== METADATA_FIELD || wire !== 2) continue;
    const entry = Object.fromEntries([...fields(value)].filter(([, type]) => type === 2)
      .map(([number, , text]) => [number, utf8.decode(text)]));
    entries[entry[1] ?? ""] = entry[2] ?? "";
  }
  return entries;
}

// {method, label} of the graph's `map`: its metadata's, or ROLLOUT for a graph that names none.
export function mapMethod(bytes) {
  const metadata = graphMetadata(bytes);
  return metadata[METHOD_KEY] ? { method: metadata[METHOD_KEY], label: metadata[LABEL_KEY] || metadata[METHOD_KEY] }
    : ROLLOUT;
}
