//! Renders this plugin's vendor-data for settings given as JSON, the way the operator's
//! component call does, without the operator: for trying settings on a real guest
//! (`scripts/guest-boot.sh` takes the output as the seed's `vendor-data`).
//!
//! `cargo run -p vendor-data-default --example render -- '{"listenPort": 8080}'`

use templates_sdk::vendor_data::{Firmware, HostFacts, MachineType, VendorDataInput};
use vendor_data_default::DefaultVendorData;

fn main() {
    let settings = std::env::args().nth(1).unwrap_or_else(|| "{}".into());
    if let Err(problems) = templates_sdk::__private::validate::<vendor_data_default::Settings>(
        &settings,
        <DefaultVendorData as templates_sdk::VendorDataPlugin>::validate_settings,
    ) {
        for p in problems {
            eprintln!("settings: {p}");
        }
        std::process::exit(1);
    }
    let input = VendorDataInput {
        proxy_name: "example".into(),
        proxy_namespace: "default".into(),
        host: HostFacts {
            name: "local".into(),
            arch: "x86_64".into(),
            kvm: false,
            libvirt_version: "9.0.0".into(),
            cpus: 2,
            numa_nodes: 1,
        },
        machine_type: MachineType {
            name: "small".into(),
            vcpus: 1,
            memory_mib: 512,
            disk_gib: 4,
            firmware: Firmware::Bios,
        },
        settings,
    };
    match templates_sdk::__private::render_vendor_data::<DefaultVendorData>(&input) {
        Ok(doc) => print!("{doc}"),
        Err(e) => {
            eprintln!("render: {e}");
            std::process::exit(1);
        }
    }
}
