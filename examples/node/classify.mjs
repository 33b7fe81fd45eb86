// Classify images with a vit_hub model from Node.js, no Python:
//
//   node classify.mjs MODEL_DIR IMAGE [IMAGE ...]
//   node classify.mjs MODEL_DIR IMAGE --map overlay.png [--rollout]
//
// MODEL_DIR holds pipeline.onnx and config.json (what `python -m vit_hub.export` writes). The
// graph does all the preprocessing itself, so the app only decodes each image to its pixels:
// uint8 [height, width, channels] in, probabilities in config.json's label order out.
// Prints one JSON line per image: {file, label, top: [[label, probability], ...]} or {file, error}.
//
// With --map (one IMAGE), it runs pipeline_explain.onnx instead (an export with
// --output-attentions writes it): its map is the one the Gradio page opens with for this model
// (integrated gradients + gradient rollout for the bundled one, gradients computed inside the
// graph), named in the graph's metadata. It adds the map [grid_h][grid_w], its method and the
// milliseconds the graph took to the line and writes the app's overlay as a PNG: over the image
// the model saw for a digit model (its canonicalised digit), over the upload for any other.
// --rollout draws attention rollout instead, the quick map: pipeline_map.onnx's (a graph without
// gradients, about half the time), or pipeline_explain.onnx's rollout output when it is alone.
// A model dir exported before pipeline_explain.onnx existed gets pipeline_map.onnx's rollout.
// The drawing is ../../vit_hub/hub/static_page/overlay.mjs, the static Space's.
// OUT must be a new file in an existing folder: an existing file (the input image above all), a
// link or a folder is refused before anything runs, and the PNG is written to a temporary file
// beside OUT, then renamed to it, so a failed write leaves nothing half-written. A failure is one
// line on stderr and a non-zero exit, never a stack trace.
import { existsSync } from "node:fs";
import { lstat, open, readFile, rename, stat, unlink } from "node:fs/promises";
import path from "node:path";
import * as ort from "onnxruntime-node";
import sharp from "sharp";
import { mapMethod, ROLLOUT } from "../../vit_hub/hub/static_page/graph_method.mjs";
import { displaySize, forDisplay, overlay } from "../../vit_hub/hub/static_page/overlay.mjs";

const TOP_K = 3;
const USAGE = "usage: node classify.mjs MODEL_DIR IMAGE [IMAGE ...] | MODEL_DIR IMAGE --map OUT.png [--rollout]";
const GRAPHS = { classify: "pipeline.onnx", map: "pipeline_map.onnx", explain: "pipeline_explain.onnx" };

async function decode(file) {
  // rotate(): apply the EXIF orientation, as a phone photo is meant to be seen.
  const { data, info } = await sharp(file).rotate().raw().toBuffer({ resolveWithObject: true });
  return new ort.Tensor("uint8", data, [info.height, info.width, info.channels]);
}

// A refusal: one line on stderr, then exit with `code` (2: the command line or the model dir is wrong).
class Refusal extends Error {
  constructor(message, code = 2) {
    super(message);
    this.code = code;
  }
}

// config.json of MODEL_DIR: a JSON object whose labels are a list of strings.
async function readConfig(modelDir) {
  const file = path.join(modelDir, "config.json");
  let text;
  try {
    text = await readFile(file, "utf8");
  } catch (error) {
    throw new Refusal(`expected config.json in ${modelDir}, found none (${error.code ?? error.message})`);
  }
  let config;
  try {
    config = JSON.parse(text);
  } catch (error) {
    throw new Refusal(`expected ${file} to be JSON, found text that is not: ${firstLine(error.message)}`);
  }
  const labels = config?.labels;
  if (!Array.isArray(labels) || !labels.every((label) => typeof label === "string")) {
    throw new Refusal(`expected ${file} to be an object with "labels", a list of strings, found ` +
      `${JSON.stringify(labels === undefined ? config : labels)?.slice(0, 80)}`);
  }
  return config;
}

function firstLine(text) {
  return String(text).split("\n")[0];
}

// Where --map may write: a new file (not the input image, not a link, nothing that exists) in an
// existing folder. Checked before anything runs, so a refusal costs no work and changes no file.
async function checkMapOut(out, input) {
  const found = await lstat(out).catch(() => null);
  if (found) {
    const sameAsInput = await sameFile(out, input);
    const what = sameAsInput ? "the input image" : found.isSymbolicLink() ? "a link" : found.isDirectory()
      ? "a folder" : found.isFile() ? "an existing file" : "an existing device or special file";
    throw new Refusal(`--map: expected a new file to write the overlay to, found ${out}, ${what}; ` +
      "give the name of a file that does not exist yet");
  }
  const folder = path.dirname(path.resolve(out));
  const parent = await stat(folder).catch(() => null);
  if (!parent?.isDirectory()) {
    throw new Refusal(`--map: expected ${out} in an existing folder, found no folder ${folder}`);
  }
}

async function sameFile(a, b) {
  const [first, second] = await Promise.all([stat(a).catch(() => null), stat(b).catch(() => null)]);
  return Boolean(first && second && first.dev === second.dev && first.ino === second.ino);
}

// Write `data` to `out` through a temporary file beside it, synced, then renamed; any failure
// removes the temporary file and is a Refusal with exit code 1.
async function writeBeside(out, data) {
  const temporary = path.join(path.dirname(out), `.classify-${process.pid}-${Date.now()}.png.partial`);
  try {
    const handle = await open(temporary, "wx");
    try {
      await handle.writeFile(data);
      await handle.sync();
    } finally {
      await handle.close();
    }
    await rename(temporary, out);
  } catch (error) {
    await unlink(temporary).catch(() => {});
    throw new Refusal(`--map: expected to write the overlay to ${out}, got ${firstLine(error.message)}`, 1);
  }
}

// Another model's graph gives probabilities for other classes: what is wrong, or null.
function labelsMismatch(session, labels, name) {
  const shape = session.outputMetadata.find((value) => value.name === "probabilities")?.shape;
  if (Array.isArray(labels) && shape?.length === 1 && shape[0] === labels.length) return null;
  return `expected ${name} to give one probability per label of config.json (${labels?.length} labels), ` +
    `found probabilities of shape ${JSON.stringify(shape ?? null)}; export the graph from this model dir`;
}

function ranked(probabilities, labels) {
  return Array.from(probabilities.data, (probability, index) => [labels[index], probability])
    .sort((a, b) => b[1] - a[1])
    .slice(0, TOP_K);
}

// What the app draws the map over, no larger than its display size: the image the model saw
// for a digit model, else the upload (a large one shrunk bilinearly, as the app does).
async function underTheMap(answer, image, config) {
  const base = config.canonicalize === "digit" ? answer.model_input : image;
  const [height, width, channels] = base.dims;
  const [shownWidth, shownHeight] = displaySize(width, height);
  if (shownWidth >= width) return { pixels: base.data, height, width, channels };
  const { data, info } = await sharp(base.data, { raw: { width, height, channels } })
    .resize(shownWidth, shownHeight, { fit: "fill", kernel: "linear" }).raw().toBuffer({ resolveWithObject: true });
  return { pixels: data, height: info.height, width: info.width, channels: info.channels };
}

// The overlay PNG of one answer's map `drawn` (its `map` or `rollout` output); returns the map as rows.
async function writeOverlay(answer, drawn, image, config, out) {
  const [gridH, gridW] = drawn.dims;
  const { pixels: base, height, width, channels } = await underTheMap(answer, image, config);
  const shown = forDisplay(base, height, width, channels, config.in_channels === 1);
  const pixels = overlay(shown, drawn.data, gridH, gridW, answer.map_colours.data);
  const png = await sharp(Buffer.from(pixels), { raw: { width: shown.width, height: shown.height, channels: 3 } })
    .png().toBuffer();
  await writeBeside(out, png);
  return Array.from({ length: gridH }, (_, row) => Array.from(drawn.data.slice(row * gridW, (row + 1) * gridW)));
}

// The graph --map runs and which of its outputs it draws: {graph, output, method: {method, label}},
// or {graph: null} when the model dir has neither map graph.
async function mapGraph(modelDir, rollout) {
  const has = (name) => existsSync(path.join(modelDir, name));
  const explain = has(GRAPHS.explain);
  const name = rollout ? (has(GRAPHS.map) ? GRAPHS.map : explain ? GRAPHS.explain : null)
    : explain ? GRAPHS.explain : has(GRAPHS.map) ? GRAPHS.map : null;
  if (!name) return { graph: null };
  const graph = path.join(modelDir, name);
  const bytes = new Uint8Array(await readFile(graph));
  const output = rollout && name === GRAPHS.explain ? "rollout" : "map";
  return { graph, bytes, output, method: output === "rollout" ? ROLLOUT : mapMethod(bytes) };
}

// One image's line: its ranking and, with --map, the map drawn (its method and the graph's milliseconds).
async function classifyOne(session, file, config, drawing) {
  const image = await decode(file);
  const started = performance.now();
  const answer = await session.run({ image });
  const spent = performance.now() - started;
  const top = ranked(answer.probabilities, config.labels);
  if (!drawing) return { file, label: top[0][0], top };
  const map = await writeOverlay(answer, answer[drawing.output], image, config, drawing.out);
  return { file, label: top[0][0], top, map, map_method: drawing.method.method, map_label: drawing.method.label,
    map_ms: Number(spent.toFixed(1)), overlay: drawing.out };
}

async function main(commandLine) {
  const rollout = commandLine.includes("--rollout");
  const argv = commandLine.filter((arg) => arg !== "--rollout");
  const at = argv.indexOf("--map");
  const mapOut = at >= 0 ? argv[at + 1] : null;
  const [modelDir, ...files] = at >= 0 ? [...argv.slice(0, at), ...argv.slice(at + 2)] : argv;
  if (!modelDir || files.length === 0 || (at >= 0 && (!mapOut || files.length !== 1)) || (rollout && !mapOut)) {
    console.error(USAGE);
    return 2;
  }
  const config = await readConfig(modelDir);
  if (mapOut) await checkMapOut(mapOut, files[0]);
  const drawing = mapOut ? { ...await mapGraph(modelDir, rollout), out: mapOut } : null;
  const graph = drawing ? drawing.graph : path.join(modelDir, GRAPHS.classify);
  if (!graph || !existsSync(graph)) {
    const expected = graph ? path.basename(graph) : `${GRAPHS.explain} or ${GRAPHS.map}`;
    console.error(`expected ${expected} in ${modelDir}, found none: write it with python -m vit_hub.export `
      + `--model ${modelDir} --out ${modelDir}${mapOut ? " --output-attentions" : ""}`);
    return 2;
  }
  const session = await ort.InferenceSession.create(drawing ? drawing.bytes : graph);
  const mismatch = labelsMismatch(session, config.labels, path.basename(graph));
  if (mismatch) {
    console.error(`error: ${mismatch}`);
    return 2;
  }
  for (const file of files) {
    try {
      console.log(JSON.stringify(await classifyOne(session, file, config, drawing)));
    } catch (error) {
      if (error instanceof Refusal) throw error; // the overlay could not be written: the command fails
      // A refused image (no ink, too large, 5 channels) or an undecodable file: its own line.
      console.log(JSON.stringify({ file, error: error.message.split("\n")[0] }));
    }
  }
  return 0;
}

// Refusals are one line on stderr; anything else is a bug and keeps its stack trace.
async function run(argv) {
  try {
    return await main(argv);
  } catch (error) {
    if (!(error instanceof Refusal)) throw error;
    console.error(`error: ${error.message}`);
    return error.code;
  }
}

process.exitCode = await run(process.argv.slice(2));
